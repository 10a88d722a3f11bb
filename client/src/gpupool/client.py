"""``Client(url, token)`` and ``AsyncClient``: the gpupool API from Python.

Both share one description of every call (``_Api``): which method and path, which model the answer
is, and whether it is safe to repeat. The clients differ only in how they send it.

- Lists are iterators over every page (the API's cursor pagination): ``for job in c.jobs(): ...``.
- A 429 is retried after its ``Retry-After``, whatever the call (the API did nothing). Connection
  errors and 502/503/504 are retried, with backoff, only for calls safe to repeat: reads, PUT and
  DELETE, and creates, which always carry an ``Idempotency-Key`` (a new UUID unless you give one),
  so the portal answers a repeat with the first result.
- A refusal raises ``ApiError`` with the API's ``code``, ``message`` and ``fields``.
"""

from __future__ import annotations

import abc
import asyncio
import email.utils
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from gpupool import config
from gpupool import models as m
from gpupool.errors import ApiError, ConnectionFailed

__all__ = ["AsyncClient", "Client"]

KINDS = {"instance": "instances", "job": "jobs"}
TERMINAL_STATES = frozenset({"stopped", "succeeded", "failed"})
RETRY_STATUSES = frozenset({502, 503, 504})
# Errors where the request may have reached the portal: retried only when a repeat is harmless.
_MAYBE_SENT = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
# Errors where it certainly did not: always retried.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _op(method: str, template: str) -> str:
    """An API operation the client calls, by method and path template: tests/client/test_client.py
    finds every one in this source and checks it against the portal's OpenAPI schema."""
    return template


@dataclass
class _Request:
    method: str
    path: str
    model: type[m.Model] | None = None
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bool = False  # the answer's bytes, not JSON
    safe: bool = False  # a POST that is harmless to repeat

    @property
    def repeatable(self) -> bool:
        return (
            self.safe or self.method in ("GET", "HEAD", "PUT", "DELETE") or "Idempotency-Key" in self.headers
        )


def _retry_after(response: httpx.Response, default: float) -> float:
    value = response.headers.get("Retry-After", "")
    if value.strip().isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _kind_path(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, not {kind!r}")
    return KINDS[kind]


def _clean(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


class _Api(abc.ABC):
    """What each call sends and what it answers; ``_run`` and ``_paginate`` send it (``Client``
    blocking, ``AsyncClient`` with coroutines)."""

    base_url: str

    @abc.abstractmethod
    def _run(self, request: _Request) -> Any: ...

    @abc.abstractmethod
    def _paginate(self, path: str, model: type[m.Model], params: dict[str, Any]) -> Any: ...

    # --- who am I, the catalog ----------------------------------------------------------------

    def me(self):
        return self._run(_Request("GET", _op("GET", "/api/v1/me/"), m.Me))

    def gpu_types(self):
        """The catalog with prices and free GPUs per region (``availability``)."""
        return self._run(_Request("GET", _op("GET", "/api/v1/gpu-types/"), m.GpuType))

    # --- instances and jobs ---------------------------------------------------------------------

    def workloads(self, kind: str, **filters: Any):
        _op("GET", "/api/v1/instances/"), _op("GET", "/api/v1/jobs/")
        return self._paginate(f"/api/v1/{_kind_path(kind)}/", m.Workload, _clean(filters))

    def jobs(self, **filters: Any):
        return self.workloads("job", **filters)

    def instances(self, **filters: Any):
        return self.workloads("instance", **filters)

    def workload(self, kind: str, id: int):
        _op("GET", "/api/v1/instances/{id}/"), _op("GET", "/api/v1/jobs/{id}/")
        return self._run(_Request("GET", f"/api/v1/{_kind_path(kind)}/{int(id)}/", m.WorkloadDetail))

    def create_workload(self, kind: str, spec: dict[str, Any], *, idempotency_key: str | None = None):
        _op("POST", "/api/v1/instances/"), _op("POST", "/api/v1/jobs/")
        return self._create(f"/api/v1/{_kind_path(kind)}/", spec, m.WorkloadDetail, idempotency_key)

    def stop_workload(self, kind: str, id: int):
        _op("POST", "/api/v1/instances/{id}/stop/"), _op("POST", "/api/v1/jobs/{id}/stop/")
        # Stopping twice is harmless: the API answers the stopped workload.
        return self._run(
            _Request("POST", f"/api/v1/{_kind_path(kind)}/{int(id)}/stop/", m.WorkloadDetail, safe=True)
        )

    def resize_job(self, id: int, gpu_count: int):
        """Resize a running elastic job: a shrink is at once, a growth as GPUs of its node free up."""
        _op("POST", "/api/v1/jobs/{id}/resize/")
        # Resizing to the same size twice is harmless: the API answers the job.
        return self._run(
            _Request(
                "POST",
                f"/api/v1/jobs/{int(id)}/resize/",
                m.WorkloadDetail,
                json={"gpu_count": gpu_count},
                safe=True,
            )
        )

    def logs(self, kind: str, id: int, *, tail: int | None = None, since: str | None = None):
        _op("GET", "/api/v1/instances/{id}/logs/"), _op("GET", "/api/v1/jobs/{id}/logs/")
        params = _clean({"tail": tail, "since": since})
        return self._run(
            _Request("GET", f"/api/v1/{_kind_path(kind)}/{int(id)}/logs/", m.WorkloadLogs, params)
        )

    # --- storage, secrets, templates ------------------------------------------------------------

    def volumes(self, **filters: Any):
        return self._paginate(_op("GET", "/api/v1/volumes/"), m.Volume, _clean(filters))

    def create_volume(self, *, name: str, region: str, size_gib: int, idempotency_key: str | None = None):
        body = {"name": name, "region": region, "size_gib": size_gib}
        return self._create(_op("POST", "/api/v1/volumes/"), body, m.Volume, idempotency_key)

    def delete_volume(self, id: int):
        _op("DELETE", "/api/v1/volumes/{id}/")
        return self._run(_Request("DELETE", f"/api/v1/volumes/{int(id)}/"))

    def secrets(self):
        return self._paginate(_op("GET", "/api/v1/secrets/"), m.Secret, {})

    def create_secret(self, *, name: str, value: str, idempotency_key: str | None = None):
        body = {"name": name, "value": value}
        return self._create(_op("POST", "/api/v1/secrets/"), body, m.Secret, idempotency_key)

    def delete_secret(self, name: str):
        _op("DELETE", "/api/v1/secrets/{name}/")
        return self._run(_Request("DELETE", f"/api/v1/secrets/{httpx.URL(path=name).raw_path.decode()}/"))

    def templates(self):
        return self._paginate(_op("GET", "/api/v1/templates/"), m.Template, {})

    # --- money ----------------------------------------------------------------------------------

    def usage(self, **filters: Any):
        return self._paginate(_op("GET", "/api/v1/usage/"), m.UsageRecord, _clean(filters))

    def invoices(self, **filters: Any):
        return self._paginate(_op("GET", "/api/v1/invoices/"), m.Invoice, _clean(filters))

    def invoice(self, id: int):
        _op("GET", "/api/v1/invoices/{id}/")
        return self._run(_Request("GET", f"/api/v1/invoices/{int(id)}/", m.Invoice))

    def invoice_pdf(self, id: int):
        """The invoice's PDF, as bytes."""
        _op("GET", "/api/v1/invoices/{id}/pdf/")
        return self._run(_Request("GET", f"/api/v1/invoices/{int(id)}/pdf/", raw=True))

    def budget(self):
        return self._run(_Request("GET", _op("GET", "/api/v1/budget/"), m.Budget))

    def set_budget(self, **fields: Any):
        """``monthly_limit`` (a Decimal or string; None for none), ``hard_limit``, ``alert_thresholds``."""
        body = {k: (str(v) if k == "monthly_limit" and v is not None else v) for k, v in fields.items()}
        return self._run(_Request("PUT", _op("PUT", "/api/v1/budget/"), m.Budget, json=body))

    # --- tokens ---------------------------------------------------------------------------------

    def tokens(self, **filters: Any):
        return self._paginate(_op("GET", "/api/v1/tokens/"), m.ApiToken, _clean(filters))

    def create_token(self, *, name: str, scopes: list[str], expires_at: str | None = None,
                     idempotency_key: str | None = None):  # fmt: skip
        body = _clean({"name": name, "scopes": scopes, "expires_at": expires_at})
        return self._create(_op("POST", "/api/v1/tokens/"), body, m.ApiTokenCreated, idempotency_key)

    def revoke_token(self, id: int):
        _op("POST", "/api/v1/tokens/{id}/revoke/")
        return self._run(_Request("POST", f"/api/v1/tokens/{int(id)}/revoke/", m.ApiToken))

    # --- webhooks (the admin scope) --------------------------------------------------------------

    def webhooks(self, **filters: Any):
        """The team's webhook endpoints (``enabled=True`` or ``False`` to filter)."""
        return self._paginate(_op("GET", "/api/v1/webhooks/"), m.WebhookEndpoint, _clean(filters))

    def webhook(self, id: int):
        _op("GET", "/api/v1/webhooks/{id}/")
        return self._run(_Request("GET", f"/api/v1/webhooks/{int(id)}/", m.WebhookEndpoint))

    def create_webhook(self, *, url: str, event_types: list[str], description: str | None = None,
                       enabled: bool | None = None, idempotency_key: str | None = None):  # fmt: skip
        """A new endpoint; its ``secret`` is in this answer only (``gpupool.webhooks.verify``)."""
        body = _clean(
            {"url": url, "event_types": event_types, "description": description, "enabled": enabled}
        )
        return self._create(_op("POST", "/api/v1/webhooks/"), body, m.WebhookEndpointCreated, idempotency_key)

    def update_webhook(self, id: int, **changes: Any):
        """Change ``url``, ``event_types``, ``description`` or ``enabled``."""
        _op("PATCH", "/api/v1/webhooks/{id}/")
        # Setting the same values twice is harmless.
        return self._run(
            _Request("PATCH", f"/api/v1/webhooks/{int(id)}/", m.WebhookEndpoint, json=changes, safe=True)
        )

    def delete_webhook(self, id: int):
        _op("DELETE", "/api/v1/webhooks/{id}/")
        return self._run(_Request("DELETE", f"/api/v1/webhooks/{int(id)}/"))

    def roll_webhook_secret(self, id: int, *, expire_previous_in_s: int = 0):
        """A new signing secret, in this answer only; deliveries from now on are signed with it, and
        with the old one too for ``expire_previous_in_s`` seconds (up to 7 days; 0: the old one
        stops now). Not repeated on a lost answer: a repeat would make another secret."""
        _op("POST", "/api/v1/webhooks/{id}/roll-secret/")
        body = {"expire_previous_in_s": expire_previous_in_s}
        return self._run(
            _Request("POST", f"/api/v1/webhooks/{int(id)}/roll-secret/", m.WebhookEndpointCreated, json=body)
        )

    def webhook_deliveries(self, **filters: Any):
        """Each event sent to each endpoint, newest first (``endpoint=ID``, ``state=...``)."""
        return self._paginate(_op("GET", "/api/v1/webhook-deliveries/"), m.WebhookDelivery, _clean(filters))

    def webhook_delivery(self, id: int):
        """One delivery with its body and every attempt (status, latency, error)."""
        _op("GET", "/api/v1/webhook-deliveries/{id}/")
        return self._run(_Request("GET", f"/api/v1/webhook-deliveries/{int(id)}/", m.WebhookDeliveryDetail))

    def redeliver_webhook(self, id: int):
        """Send a delivery again now (not repeated on a lost answer: that would send it twice)."""
        _op("POST", "/api/v1/webhook-deliveries/{id}/redeliver/")
        return self._run(
            _Request("POST", f"/api/v1/webhook-deliveries/{int(id)}/redeliver/", m.WebhookDelivery)
        )

    def webhook_event_types(self):
        """The event types an endpoint may ask for, each with what it means."""
        return self._run(_Request("GET", _op("GET", "/api/v1/webhook-event-types/"), m.EventType))

    # --- helpers --------------------------------------------------------------------------------

    def _create(self, path: str, body: Any, model: type[m.Model], key: str | None):
        headers = {"Idempotency-Key": key or str(uuid.uuid4())}
        return self._run(_Request("POST", path, model, json=body, headers=headers))

    def follow_url(self, kind: str, id: int, since: str | None = None) -> str:
        query = f"follow=1&since={since}" if since else "follow=1&tail=100"
        return f"{self.base_url}/api/v1/{_kind_path(kind)}/{int(id)}/logs/?{query}"


def _answer(request: _Request, response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = None
        raise ApiError.from_response(response.status_code, body, response.text)
    if request.raw:
        return response.content
    if response.status_code == 204 or not response.content:
        return None
    data = response.json()
    if request.model is None:
        return data
    if isinstance(data, list):
        return [request.model.from_api(item) for item in data]
    return request.model.from_api(data)


class _Transport:
    """Settings shared by both clients."""

    def _setup(self, url: str, token: str, retries: int, backoff: float, max_wait: float) -> None:
        if not url:
            raise ValueError("url is required (the portal, e.g. https://gpupool.example.com)")
        if not token:
            raise ValueError("token is required (an API token, gpp_...)")
        self.base_url = url.rstrip("/")
        self.retries, self.backoff, self.max_wait = retries, backoff, max_wait
        self.auth_headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    def _delay(self, request: _Request, attempt: int, response: httpx.Response | None,
               error: Exception | None) -> float | None:  # fmt: skip
        """Seconds to wait before trying again, or None to give up."""
        if attempt >= self.retries:
            return None
        if response is not None and response.status_code == 429:
            return min(_retry_after(response, self.backoff * 2**attempt), self.max_wait)
        if not request.repeatable and not isinstance(error, _NOT_SENT):
            return None
        if response is not None and response.status_code not in RETRY_STATUSES:
            return None
        return min(self.backoff * 2**attempt, self.max_wait)


class Client(_Api, _Transport):
    """The API, synchronously. ``with Client(url, token) as c: c.jobs()``."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 4,
                 backoff: float = 0.5, max_retry_wait: float = 60.0,
                 transport: httpx.BaseTransport | None = None) -> None:  # fmt: skip
        self._setup(url, token, retries, backoff, max_retry_wait)
        self.http = httpx.Client(base_url=self.base_url, headers=self.auth_headers, timeout=timeout,
                                 transport=transport)  # fmt: skip

    @classmethod
    def from_config(cls, profile: str | None = None, **kwargs: Any) -> Client:
        """The portal and token as the command line finds them: ``GPUPOOL_URL`` and
        ``GPUPOOL_TOKEN``, else the profile (``gpupool login``) named or the default one."""
        settings = config.resolve(profile)
        return cls(settings.url, settings.token, **kwargs)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def send(self, request: _Request) -> httpx.Response:
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = self.http.request(request.method, request.path, params=request.params,
                                             json=request.json, headers=request.headers)  # fmt: skip
            except httpx.TransportError as exc:
                error = exc
            if (
                response is not None
                and response.status_code != 429
                and response.status_code not in RETRY_STATUSES
            ):
                return response
            delay = self._delay(request, attempt, response, error)
            if delay is None:
                if response is not None:
                    return response
                raise ConnectionFailed(f"{self.base_url}: {error}") from error
            time.sleep(delay)
            attempt += 1

    def _run(self, request: _Request) -> Any:
        return _answer(request, self.send(request))

    def _paginate(self, path: str, model: type[m.Model], params: dict[str, Any]) -> Iterator[Any]:
        request = _Request("GET", path, None, dict(params))
        while True:
            page = _answer(request, self.send(request))
            for item in page["results"]:
                yield model.from_api(item)
            if not page.get("next"):
                return
            request = _Request("GET", page["next"])  # absolute: httpx keeps it as given

    def follow_logs(self, kind: str, id: int, *, since: str | None = None,
                    poll_s: float = 1.0) -> Iterator[dict]:  # fmt: skip
        """Each new line of the workload's output as it is written; ends when the workload ends.
        Uses the portal's event stream, or polls where the server does not stream (a plain WSGI
        deployment answers ``follow`` with a 400)."""
        with self.http.stream("GET", self.follow_url(kind, id, since), timeout=None) as response:
            if response.status_code == 200:
                # The stream stays open; a quiet spell (its keepalive) after the end closes it here.
                ended = lambda: self.workload(kind, id).state in TERMINAL_STATES  # noqa: E731
                yield from _sse_lines(response.iter_lines(), ended)
                return
            response.read()
            error = ApiError.from_response(response.status_code, _json_or_none(response), response.text)
            if "follow" not in error.fields:
                raise error
        if since is None:
            page = self.logs(kind, id, tail=100)
            yield from page.lines or []
            since = page.next
        while True:
            finished = self.workload(kind, id).state in TERMINAL_STATES
            page = self.logs(kind, id, since=since, tail=1000)
            yield from page.lines or []
            since = page.next
            if finished and not page.lines:
                return
            if not page.lines:
                time.sleep(poll_s)


class AsyncClient(_Api, _Transport):
    """The API for asyncio: the same methods, awaited; lists are async iterators."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 4,
                 backoff: float = 0.5, max_retry_wait: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:  # fmt: skip
        self._setup(url, token, retries, backoff, max_retry_wait)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.auth_headers, timeout=timeout,
                                      transport=transport)  # fmt: skip

    @classmethod
    def from_config(cls, profile: str | None = None, **kwargs: Any) -> AsyncClient:
        """As ``Client.from_config``."""
        settings = config.resolve(profile)
        return cls(settings.url, settings.token, **kwargs)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def send(self, request: _Request) -> httpx.Response:
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = await self.http.request(request.method, request.path, params=request.params,
                                                   json=request.json, headers=request.headers)  # fmt: skip
            except httpx.TransportError as exc:
                error = exc
            if (
                response is not None
                and response.status_code != 429
                and response.status_code not in RETRY_STATUSES
            ):
                return response
            delay = self._delay(request, attempt, response, error)
            if delay is None:
                if response is not None:
                    return response
                raise ConnectionFailed(f"{self.base_url}: {error}") from error
            await asyncio.sleep(delay)
            attempt += 1

    async def _run(self, request: _Request) -> Any:
        return _answer(request, await self.send(request))

    async def follow_logs(self, kind: str, id: int, *, since: str | None = None,
                          poll_s: float = 1.0) -> AsyncIterator[dict]:  # fmt: skip
        """``Client.follow_logs`` for asyncio: ``async for line in c.follow_logs("job", 42)``."""
        async with self.http.stream("GET", self.follow_url(kind, id, since), timeout=None) as response:
            if response.status_code == 200:
                data: list[str] = []
                async for line in response.aiter_lines():
                    item = _sse_feed(line, data)
                    if item is _KEEPALIVE:
                        if (await self.workload(kind, id)).state in TERMINAL_STATES:
                            return
                    elif item is not None:
                        yield item
                return
            await response.aread()
            error = ApiError.from_response(response.status_code, _json_or_none(response), response.text)
            if "follow" not in error.fields:
                raise error
        if since is None:
            page = await self.logs(kind, id, tail=100)
            for line in page.lines or []:
                yield line
            since = page.next
        while True:
            finished = (await self.workload(kind, id)).state in TERMINAL_STATES
            page = await self.logs(kind, id, since=since, tail=1000)
            for line in page.lines or []:
                yield line
            since = page.next
            if finished and not page.lines:
                return
            if not page.lines:
                await asyncio.sleep(poll_s)

    async def _paginate(self, path: str, model: type[m.Model], params: dict[str, Any]) -> AsyncIterator[Any]:
        request = _Request("GET", path, None, dict(params))
        while True:
            page = _answer(request, await self.send(request))
            for item in page["results"]:
                yield model.from_api(item)
            if not page.get("next"):
                return
            request = _Request("GET", page["next"])


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


_KEEPALIVE = object()


def _sse_feed(line: str, data: list[str]) -> Any:
    """One line of a server-sent event stream: the event's parsed ``data:`` when ``line`` ends one,
    ``_KEEPALIVE`` at a comment (the server's keepalive, sent when it has been quiet), else None."""
    if line.startswith("data:"):
        data.append(line[5:].lstrip())
    elif line.startswith(":"):
        return _KEEPALIVE
    elif line == "" and data:
        event = json.loads("\n".join(data))
        data.clear()
        return event
    return None


def _sse_lines(lines: Iterable[str], ended: Callable[[], bool]) -> Iterator[dict]:
    """Each event of the stream; at each keepalive, stops if ``ended()``."""
    data: list[str] = []
    for line in lines:
        item = _sse_feed(line, data)
        if item is _KEEPALIVE:
            if ended():
                return
        elif item is not None:
            yield item
