"""A task for tests/portal/test_task_redelivery.py, loaded by the worker it starts (``--include``):
each run appends a line to the file it names; the first run then waits, as a long task does, for
the worker to be killed."""

from __future__ import annotations

import time
from pathlib import Path

from celery import shared_task


@shared_task(name="tests.redelivery.record_and_wait")
def record_and_wait(path: str) -> int:
    marks = Path(path)
    with marks.open("a") as f:
        f.write("run\n")
    runs = len(marks.read_text().splitlines())
    if runs == 1:
        time.sleep(120)
    return runs
