"""The long-running processes keep the garbage collector off what they loaded (portal.heap)."""

from __future__ import annotations

import pytest

from tests.conftest import python_run


@pytest.mark.parametrize("signal", ["worker_ready", "beat_init"])
def test_a_celery_worker_and_beat_freeze_what_they_loaded_once_ready(signal):
    """Celery sends ``worker_ready`` once a worker has loaded its tasks and ``beat_init`` as beat
    starts; after it the loaded heap is frozen and young collections run far less often than at
    the default threshold. Before it nothing is frozen."""
    code = (
        "import gc; import portal.celery; from celery import signals; "
        "print(gc.get_freeze_count(), gc.get_threshold()[0]); "
        f"signals.{signal}.send(sender=None); "
        "print(gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()[0])"
    )
    done = python_run(code, DJANGO_SETTINGS_MODULE="tests.settings")
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.splitlines()
    assert before.split() == ["0", "700"]
    frozen, tracked, young = (int(v) for v in after.split())
    assert young >= 10_000
    assert frozen > 20_000 and tracked < frozen / 10, (frozen, tracked)
