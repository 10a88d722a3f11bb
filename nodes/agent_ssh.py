"""The agent protocol's SSH part (nodes/PROTOCOL.md, "SSH into workloads").

- ``PUT /agent/v1/nodes/<id>/ssh-endpoint``: the agent says where its SSH endpoint listens (its
  port on the node's address) and its host key, at every start, or that it serves none.
- ``GET /agent/v1/nodes/<id>/workloads/<workload_id>/ssh-keys``: at each login, the keys that may
  log in to that workload now. Only for the node that holds the workload, while it runs (404
  otherwise).

Who may log in is scheduling's rule (workloads, tenants and their people), which this app does not
import: scheduling registers the function that answers (``register_ssh_keys_source``) when it loads.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from django.db import transaction
from django.http import JsonResponse
from django.views.decorators.http import require_GET, require_http_methods

from nodes.agent.workload_rules import WorkloadRuleError, parse_ssh_public_key
from nodes.agent_views import agent_endpoint, authenticate_for
from nodes.models import Node
from nodes.validation import fail, get_int, require_object
from portal.errors import NotFound

SshKeysSource = Callable[..., list[dict[str, str]]]
_source: list[SshKeysSource] = []


def register_ssh_keys_source(source: SshKeysSource) -> None:
    """``source(node_id=..., workload_id=...)`` answers the keys of a workload on a node, or raises
    :class:`NotFound`. One source; registering again replaces it."""
    _source[:] = [source]


def _body(request) -> dict:
    try:
        data = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        raise fail("body", "Not valid JSON (or nested more than 1024 levels deep).") from None
    return require_object(data, "body")


@require_http_methods(["PUT"])
@agent_endpoint
def ssh_endpoint(request, node_id: int):
    """Body ``{"port": 2222, "host_key": "ssh-ed25519 AAAA..."}``, or ``{"port": null}`` for none."""
    authenticate_for(request, node_id)
    data = _body(request)
    port = get_int(data, "port", "port", min_value=1, max_value=65535)
    host_key = ""
    if port is not None:
        try:
            host_key = " ".join(parse_ssh_public_key(data.get("host_key"), field="host_key").line.split()[:2])
        except WorkloadRuleError as exc:
            raise fail(exc.field, exc.message) from None
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(ssh_port=port, ssh_host_key=host_key)
    return JsonResponse({"port": port, "host_key": host_key})


@require_GET
@agent_endpoint
def workload_ssh_keys(request, node_id: int, workload_id: str):
    """``{"workload_id", "keys": [{"key", "fingerprint", "source"}]}``."""
    authenticate_for(request, node_id)
    if not _source:
        raise NotFound("No such running workload on this node.")
    keys = _source[0](node_id=node_id, workload_id=workload_id)
    return JsonResponse({"workload_id": workload_id, "keys": keys})
