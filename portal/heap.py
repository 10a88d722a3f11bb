"""The cyclic garbage collector in the long-running processes: web, Celery workers and beat.

What such a process has loaded once it is ready to serve (Django, every app, the URL conf, the
task modules: well over 100,000 objects) lives as long as the process. A full collection
traverses every tracked object and stops every thread of the process while it runs; ``gc.freeze``
moves what is loaded to the permanent generation, which no collection traverses. What is still
traversed is the live state: requests and tasks in flight, open connections. Under
bench/scale.py a web process made 7 full collections, 1.35 s in all and up to 280 ms each, before;
6-7, 0.6-0.9 s in all and up to 160-230 ms each, frozen (then with 500 agents' long polls on each
web process). The scheduling worker made 13, 2.0 s in all and up to 371 ms each, before; none
during the load, frozen.

A request or a task allocates thousands of objects, nearly all freed by reference counting when it
ends; the young generation is collected every ``YOUNG_THRESHOLD`` allocations (net) instead of
Python's 700, which ran about three times per workload list page: 3.5 % less CPU for a list, a
detail and the GPU catalog (one web process, alternating, median of 8 rounds).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def heap_freeze_loaded() -> None:
    """Keep the collector off what is loaded by now; collect the young generation less often."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 10)
