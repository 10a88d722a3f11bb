"""``POST /agent/v1/nodes/<id>/logs``: workload output from the agent (nodes/PROTOCOL.md).

Served through Django's normal chain (not the agent fast path). Authenticated by the node
credential like heartbeats; idempotent by the batch's ``seq``; lines of workloads not placed on
this node are refused (listed in the answer, not stored). Followers of the workloads that got
lines are woken through the channel layer once the lines are committed.
"""

from __future__ import annotations

import time

from channels.layers import get_channel_layer
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from nodes import metrics as node_metrics
from nodes.agent_views import AUTH_SCHEME, authenticate_for, in_db_thread
from nodes.services.logs import log_batch_parse, node_logs_ingest, workload_logs_group
from portal.api.errors import error_response
from portal.errors import DomainError


def _logs_sync(authorization: str, body: bytes, node_id: int):
    authenticate_for(authorization, node_id)  # 401 / 404 before anything is read
    batch = log_batch_parse(body, now=time.time())
    return node_logs_ingest(node_id=node_id, batch=batch)


@csrf_exempt
@require_POST
async def logs(request, node_id: int):
    try:
        result = await in_db_thread(_logs_sync)(
            request.headers.get("Authorization", ""), request.body, node_id
        )
    except DomainError as exc:
        if exc.status_code in (400, 401):
            node_metrics.AGENT_REJECTED.labels(status=str(exc.status_code)).inc()
        response = error_response(exc.status_code, exc.message, code=exc.code, fields=exc.fields)
        if exc.status_code == 401:
            response["WWW-Authenticate"] = f'{AUTH_SCHEME} realm="agent"'
        return response
    layer = get_channel_layer()
    if layer is not None:
        for workload_id in result.written:
            await layer.group_send(workload_logs_group(workload_id), {"type": "logs.appended"})
    data: dict = {"status": result.status, "lines": result.lines}
    if result.refused:
        data["refused"] = result.refused
    return JsonResponse(data)
