"""Asking for a scheduling cycle: on commit, debounced, through Celery.

Requests within ``SCHEDULING_CYCLE_DEBOUNCE_S`` of each other share one task, enqueued with that
countdown. The mark that says a task is on its way holds that task's own token, and only that task
clears it, when it starts: a request made while its cycle runs gets another task. Beat's cycles
(every ``SCHEDULING_CYCLE_INTERVAL_S``) leave the mark alone. When every cycle cleared it, each
beat cycle let a second chain of debounced tasks start beside the one already waiting, and the
chains never merged: under steady submissions cycles ran about 2.6 times a second instead of
under 2. A lost request (broker down, cache lost) only delays work until beat's next cycle.
``SCHEDULING_TRIGGER_CYCLES = False`` turns the triggers off (beat still runs).
"""

from __future__ import annotations

import logging
import uuid

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

logger = logging.getLogger(__name__)

DEBOUNCE_KEY = "scheduling:cycle:requested"


def cycle_request(*, reason: str) -> None:
    if not settings.SCHEDULING_TRIGGER_CYCLES:
        return

    def enqueue() -> None:
        delay = settings.SCHEDULING_CYCLE_DEBOUNCE_S
        token = uuid.uuid4().hex
        if not cache.add(DEBOUNCE_KEY, token, timeout=max(int(delay * 10), 5)):
            return
        from scheduling.tasks import run_cycle

        try:
            run_cycle.apply_async(kwargs={"token": token}, countdown=delay, retry=False)
        except Exception:
            cycle_request_clear(token)
            logger.warning(
                "Could not enqueue a scheduling cycle (%s); beat will run one", reason, exc_info=True
            )

    transaction.on_commit(enqueue)


def cycle_request_clear(token: str | None = None) -> None:
    """Clear the mark: the one holding ``token`` (a triggered task starting), or whatever it holds.

    A read then a delete, not one atomic step: should the mark expire and another request set it
    in between, that request's task still runs, and the next request enqueues one more cycle than
    needed; no request is lost."""
    if token is None or cache.get(DEBOUNCE_KEY) == token:
        cache.delete(DEBOUNCE_KEY)
