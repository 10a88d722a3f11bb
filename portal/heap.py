"""The cyclic garbage collector in the long-running processes: web, Celery workers and beat.

What such a process has loaded once it is ready to serve (Django, every app, the URL conf, the
task modules: well over 100,000 objects) lives as long as the process. A full collection
traverses every tracked object and stops every thread of the process while it runs; ``gc.freeze``
moves what is loaded to the permanent generation, which no collection traverses. What is still
traversed is the live state: requests and tasks in flight, open connections.

A request or a task allocates thousands of objects, nearly all freed by reference counting when it
ends; the young generation is collected every ``YOUNG_THRESHOLD`` allocations (net) instead of
Python's 700, a few times less often for a workload list page.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def heap_freeze_loaded() -> None:
    """Keep the collector off what is loaded by now; collect the young generation less often."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 10)
