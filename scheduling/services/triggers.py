"""Asking for a scheduling cycle: on commit, debounced, through Celery.

Requests within ``SCHEDULING_CYCLE_DEBOUNCE_S`` of each other share one task, enqueued with that
countdown; the task clears the mark when it starts, so a request made while a cycle runs gets
another. Beat runs a cycle every few seconds anyway, so a lost request (broker down, cache lost)
only delays work. ``SCHEDULING_TRIGGER_CYCLES = False`` turns the triggers off (beat still runs).
"""

from __future__ import annotations

import logging

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
        if not cache.add(DEBOUNCE_KEY, reason, timeout=max(int(delay * 10), 5)):
            return
        from scheduling.tasks import run_cycle

        try:
            run_cycle.apply_async(countdown=delay, retry=False)
        except Exception:
            cache.delete(DEBOUNCE_KEY)
            logger.warning(
                "Could not enqueue a scheduling cycle (%s); beat will run one", reason, exc_info=True
            )

    transaction.on_commit(enqueue)


def cycle_request_clear() -> None:
    cache.delete(DEBOUNCE_KEY)
