"""The replay runs elastic pods through the engine's elastic moves and reports per-group figures."""

from __future__ import annotations

from scheduling.simulator.replay import run_replay
from scheduling.simulator.trace import TracePod

from .factories import CATALOG, node


def _pod(name, gpus, t, end):
    return TracePod(name, 1000, 1024, gpus, 1000, (), "LS", t, end)


def test_an_elastic_pod_grows_then_yields_and_nobody_waits():
    pods = [_pod("e", 2, 0, 1000), _pod("r", 4, 10, 500), _pod("s", 2, 20, 400)]
    common: dict = {"elastic": {"e": (2, 8)}, "groups": {"e": "elastic", "r": "plain", "s": "plain"}}
    on = run_replay([node("n1", gpus=8)], dict(CATALOG), pods, **common)
    assert on.resizes >= 2  # grown into the idle node, then shrunk for "r" (and "s")
    assert on.groups["plain"] == {
        "pods": 2,
        "placed": 2,
        "allocation_rate_pct": 100.0,
        "delay_s": {"mean": 0.0, "p50": 0.0, "p95": 0.0},
    }
    assert on.utilisation_mean > run_replay([node("n1", gpus=8)], dict(CATALOG), pods, **common,
                                            elastic_moves=False).utilisation_mean  # fmt: skip
