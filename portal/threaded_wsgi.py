"""A WSGI application served to an ASGI server from a fixed pool of threads, one hop each way.

a2wsgi's ``WSGIMiddleware`` (which this replaces; its ``build_environ`` is used as it is) hands each
piece of a response back to the event loop as it is made, and the thread waits for it: the status
and headers, every body chunk and the end are a cross-thread call each (a task on the loop, a wake-up
through the loop's pipe, a lock the thread sleeps on), and so is every read of the request body.
Measured under uvicorn on ``/healthz`` (a view of 0.09 ms): about 1 ms of the process's CPU a
request. Here, as in Django's own ASGI handler, the request body is read on the event loop before the
view runs (spooled to a temporary file past ``FILE_UPLOAD_MAX_MEMORY_SIZE``), the thread runs the
application and gathers the response, and the loop sends it. A streaming response (one whose length
is not known: ``StreamingHttpResponse``, a ``FileResponse``) is sent chunk by chunk from the thread,
each chunk waiting for the loop to take it, as a2wsgi does. What an application passes to WSGI's
``write()`` callable comes first, as the specification orders it.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from a2wsgi.wsgi import build_environ
from django.conf import settings


class _Response:
    """What the application answered, gathered in its thread."""

    __slots__ = ("body", "headers", "status", "streamed", "written")

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.streamed = False
        self.written: list[bytes] = []  # through WSGI's write(), which comes before the iterable


class ThreadedWSGI:
    def __init__(self, app, workers: int) -> None:
        self.app = app
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wsgi")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"ThreadedWSGI serves HTTP only, not {scope['type']!r}")
        body = await self._read_body(receive)
        if body is None:  # the client went away before it finished sending
            return
        try:
            environ = build_environ(scope, body)
            environ["wsgi.errors"] = sys.stderr
            loop = asyncio.get_running_loop()
            run = contextvars.copy_context().run
            response = await loop.run_in_executor(self.executor, run, self._run, environ, loop, send)
        finally:
            body.close()
        if not response.streamed:
            await send(
                {"type": "http.response.start", "status": response.status, "headers": response.headers}
            )
            await send({"type": "http.response.body", "body": response.body})

    @staticmethod
    async def _read_body(receive) -> tempfile.SpooledTemporaryFile | None:
        """The request body, as Django's ASGIHandler reads it: in memory up to
        FILE_UPLOAD_MAX_MEMORY_SIZE, on disk past it."""
        # Closed by the caller, or below when the client leaves.
        body = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")  # noqa: SIM115
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body.close()
                return None
            if chunk := message.get("body"):
                body.write(chunk)
            if not message.get("more_body", False):
                break
        body.seek(0)
        return body

    def _run(self, environ: dict[str, Any], loop: asyncio.AbstractEventLoop, send) -> _Response:
        """In a pool thread: the application's answer, gathered; or, for a streaming one, sent."""
        response = _Response()

        def start_response(status: str, headers: list[tuple[str, str]], exc_info=None):
            response.status = int(status.split(" ", 1)[0])
            response.headers = [
                (name.lower().encode("latin1"), value.encode("latin1")) for name, value in headers
            ]
            return response.written.append

        iterable = self.app(environ, start_response)
        try:
            # Django's responses say whether they stream; of other iterables, a list or tuple does not.
            if not getattr(iterable, "streaming", not isinstance(iterable, list | tuple)):
                response.body = b"".join([*response.written, *iterable])
                return response
            response.streamed = True

            def to_loop(message: dict[str, Any]) -> None:
                asyncio.run_coroutine_threadsafe(send(message), loop).result()

            chunks = iter(iterable)
            first = next(chunks, b"")  # start_response may be called as the first chunk is made
            to_loop({"type": "http.response.start", "status": response.status, "headers": response.headers})
            for chunk in [*response.written, first]:
                to_loop({"type": "http.response.body", "body": chunk, "more_body": True})
            for chunk in chunks:
                if chunk:
                    to_loop({"type": "http.response.body", "body": chunk, "more_body": True})
            to_loop({"type": "http.response.body", "body": b""})
            return response
        finally:
            if hasattr(iterable, "close"):
                iterable.close()
