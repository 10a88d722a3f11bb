"""End to end: a MIG slice through the real portal and the real agent program (simulated collector
and runtime): the start command makes the slice and runs the workload on it, its telemetry lands on
the slice's GPU, and when the workload exits the slice is gone (MIG mode off) before the portal hears
of the exit. The harness (portal in a thread, agent process, own database) is the one of
``test_e2e_agent``."""

from __future__ import annotations

import pytest

from nodes.models import Gpu, GpuSample, NodeCommand
from nodes.services.commands import node_command_enqueue
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    signals,
    start_agent,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_a_mig_workload_runs_on_its_own_slice_which_goes_with_it(start_agent, signals):  # noqa: F811
    agent = start_agent("e2e-mig", gpus=2)
    node = registered(agent)
    gpu0 = Gpu.objects.get(node=node, index=0)
    payload = {
        "workload_id": "910001",
        "image": "ghcr.io/acme/infer:1",
        "gpu_uuids": [agent.uuids[0]],
        "gpu_fraction_milli": 142,
        "mig_profile": "1g.10gb",
        "env": {"GPUPOOL_SIM_DURATION_S": "2"},
    }
    command = node_command_enqueue(node=node, kind="start_workload", payload=payload)
    wait_for(lambda: NodeCommand.objects.get(pk=command.pk).state == "succeeded", what="the start")
    command.refresh_from_db()
    mig_uuid = command.result["mig_uuid"]
    assert mig_uuid.startswith("MIG-") and mig_uuid != agent.uuids[0]
    assert f"made MIG slice {mig_uuid} (1g.10gb) for workload 910001" in agent.log

    # While it runs, GPU 0 is in MIG mode (no utilisation counter) and runs the workload's process.
    running = wait_for(
        lambda: (
            GpuSample.objects.filter(gpu=gpu0, util_pct__isnull=True, processes__0__workload_id="910001")
            .order_by("ts")
            .first()
        ),
        what="a sample of the workload on its slice",
    )
    wait_for(lambda: signals["workload_exited"], what="the exit")
    (exited,) = signals["workload_exited"]
    assert (exited["workload_id"], exited["state"], exited["exit_code"]) == ("910001", "exited", 0)
    assert f"destroyed MIG slice {mig_uuid} of workload 910001 (MIG mode off)" in agent.log
    # Afterwards GPU 0 is a plain GPU again: utilisation is reported and nothing runs there.
    wait_for(
        lambda: GpuSample.objects.filter(gpu=gpu0, ts__gt=running.ts, util_pct__isnull=False).exists(),
        what="a sample with MIG mode off",
    )
    assert agent.stop() == 0
