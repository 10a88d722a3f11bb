"""Races for the PostgreSQL concurrency tests: one callable run by several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connections


def together(fn: Callable[[], object], n: int = 4) -> list[BaseException]:
    """Run ``fn`` in ``n`` threads released at the same moment (a barrier); each thread closes its
    database connections when done. Returns what the calls raised, for the test to assert on."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def go():
        try:
            barrier.wait()
            fn()
        except BaseException as exc:  # collected and asserted on by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
