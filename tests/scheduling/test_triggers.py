"""The debounced cycle trigger: one task on its way at a time, whatever beat does meanwhile."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from scheduling import tasks
from scheduling.services.triggers import DEBOUNCE_KEY, cycle_request, cycle_request_clear

pytestmark = pytest.mark.django_db


@pytest.fixture
def asked(settings, monkeypatch):
    settings.SCHEDULING_TRIGGER_CYCLES = True
    cycle_request_clear()
    calls: list[dict] = []
    monkeypatch.setattr(tasks.run_cycle, "apply_async", lambda **kwargs: calls.append(kwargs))
    yield calls
    cycle_request_clear()


def _request(capture, reason="submit"):
    with capture(execute=True):
        cycle_request(reason=reason)


def test_requests_while_a_task_is_on_its_way_share_it(asked, django_capture_on_commit_callbacks):
    for _ in range(5):
        _request(django_capture_on_commit_callbacks)
    assert len(asked) == 1
    assert asked[0]["kwargs"]["token"] == cache.get(DEBOUNCE_KEY)


def test_the_triggered_task_clears_its_own_mark_when_it_starts(asked, django_capture_on_commit_callbacks):
    _request(django_capture_on_commit_callbacks)
    tasks.run_cycle(**asked[0]["kwargs"])
    assert cache.get(DEBOUNCE_KEY) is None
    _request(django_capture_on_commit_callbacks)  # asked while (or after) that cycle ran
    assert len(asked) == 2


def test_beats_cycle_leaves_the_waiting_tasks_mark_alone(asked, django_capture_on_commit_callbacks):
    """Clearing it there started a second chain of debounced tasks beside the waiting one."""
    _request(django_capture_on_commit_callbacks)
    tasks.run_cycle()  # beat's
    _request(django_capture_on_commit_callbacks)
    assert len(asked) == 1


def test_a_stale_token_does_not_clear_a_newer_mark(asked, django_capture_on_commit_callbacks):
    _request(django_capture_on_commit_callbacks)
    stale = asked[0]["kwargs"]["token"]
    cycle_request_clear(stale)  # (as if the mark had expired before its task started)
    _request(django_capture_on_commit_callbacks)
    assert len(asked) == 2
    tasks.run_cycle(token=stale)
    assert cache.get(DEBOUNCE_KEY) == asked[1]["kwargs"]["token"]
    _request(django_capture_on_commit_callbacks)
    assert len(asked) == 2


def test_a_failed_enqueue_clears_the_mark(asked, monkeypatch, django_capture_on_commit_callbacks):
    def refuse(**kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr(tasks.run_cycle, "apply_async", refuse)
    _request(django_capture_on_commit_callbacks)
    assert cache.get(DEBOUNCE_KEY) is None
