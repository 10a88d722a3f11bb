"""A worker killed with ``kill -9`` in the middle of a task: the task is not lost, it runs again on
the next worker once the broker's visibility timeout has passed (acks late), minutes rather than
hours later. Real Redis (a server of the test's own) and real Celery workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _worker(redis_url: str, name: str, **env: str) -> subprocess.Popen:
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": "1",
        "REDIS_URL": redis_url,
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "--include", "tests.portal.redelivery_tasks",
         "-Q", "default", "-n", f"{name}@%h", "--pool", "threads", "-c", "1", "--loglevel", "WARNING"],
        cwd=ROOT, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _send(redis_url: str, marks: Path, **env: str) -> None:
    from tests.conftest import python_run

    code = (
        "import django; django.setup(); from portal.celery import app; "
        f"app.send_task('tests.redelivery.record_and_wait', args=[{str(marks)!r}], queue='default')"
    )
    sent = python_run(code, DJANGO_SETTINGS_MODULE="portal.settings", DEBUG="1", REDIS_URL=redis_url, **env)
    assert sent.returncode == 0, sent.stderr


VISIBILITY_S = 8


def test_a_task_of_a_killed_worker_runs_again_after_the_visibility_timeout(private_redis, tmp_path):
    url, *_ = private_redis
    # Limits short enough for a visibility timeout of seconds (the defaults make it 21 minutes).
    env = {
        "GPUPOOL_TASK_TIME_LIMIT_S": "4",
        "GPUPOOL_LONG_TASK_TIME_LIMIT_S": "4",
        "GPUPOOL_TASK_LONGEST_COUNTDOWN_S": "1",
        "CELERY_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S),
    }
    marks = tmp_path / "marks"
    first = _worker(url, "first", **env)
    second = None
    try:
        _send(url, marks, **env)
        assert _wait(lambda: marks.exists(), 60), "the first worker never ran the task"
        os.killpg(first.pid, signal.SIGKILL)  # in the middle of the task: never acknowledged
        first.wait(10)
        killed_at = time.monotonic()
        second = _worker(url, "second", **env)
        assert _wait(lambda: len(marks.read_text().splitlines()) == 2, 60), "the task was lost"
        # Not before the visibility timeout: a task still running elsewhere is not started twice.
        assert time.monotonic() - killed_at >= VISIBILITY_S - 3
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
