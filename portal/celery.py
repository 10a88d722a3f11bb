import os
import time

from celery import Celery
from celery.signals import beat_init, before_task_publish, task_postrun, task_prerun, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("gpupool")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

PUBLISHED_AT = "published_at"


@worker_ready.connect(dispatch_uid="gpupool.worker_heap")
@beat_init.connect(dispatch_uid="gpupool.beat_heap")
def _freeze_loaded_heap(**kwargs):
    """Once the worker or beat has loaded the tasks (portal.heap)."""
    from portal.heap import heap_freeze_loaded

    heap_freeze_loaded()


@before_task_publish.connect(dispatch_uid="gpupool.published_at")
def _stamp_published_at(headers=None, **kwargs):
    """Every message carries its publish time (Unix seconds) for the task latency metric."""
    if headers is not None:
        headers.setdefault(PUBLISHED_AT, time.time())


@task_prerun.connect(dispatch_uid="gpupool.task_prerun")
def _task_started(task_id=None, task=None, **kwargs):
    from portal.logging import log_context_start

    task.request._gpupool_log_token = log_context_start(task_id=task_id, task_name=task.name)
    _record_latency(task)


@task_postrun.connect(dispatch_uid="gpupool.task_postrun")
def _task_finished(task=None, **kwargs):
    from portal.logging import log_context_reset

    token = getattr(task.request, "_gpupool_log_token", None)
    if token is not None:
        log_context_reset(token)


def _record_latency(task) -> None:
    request = task.request
    if request.is_eager:
        return
    published = getattr(request, PUBLISHED_AT, None) or (request.headers or {}).get(PUBLISHED_AT)
    if published is None:
        return
    start = float(published)
    if request.eta:  # a countdown is not latency
        from datetime import datetime

        start = max(start, datetime.fromisoformat(str(request.eta)).timestamp())
    queue = (request.delivery_info or {}).get("routing_key") or "unknown"
    from portal.metrics import TASK_LATENCY, metrics_store_safely

    metrics_store_safely(TASK_LATENCY.observe(max(time.time() - start, 0.0), queue, task.name))
