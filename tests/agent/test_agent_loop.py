"""The agent loop against a fake portal over real HTTP: registration, numbered heartbeats, commands
run once, outages with nothing lost or doubled, bad batches, credential loss."""

from __future__ import annotations

import itertools
import json
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nodes.agent.agent import Agent, FatalAgentError
from nodes.agent.buffer import Buffer
from nodes.agent.config import AgentConfig
from tests.agent.conftest import H100, AgentThread, wait_for
from tests.agent.fakeportal import FakePortal


def contiguous(seqs: list[int]) -> bool:
    return seqs == list(range(1, len(seqs) + 1))


def test_register_heartbeat_and_restart(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    config = make_config(labels={"rack": "r12"}, cpu_cores=96, ram_mib=1048576)
    first = run_agent(Agent(config))
    wait_for(lambda: len(portal.seqs(1)) >= 3, what="three heartbeats")
    first.stop()
    assert first.error is None

    register = portal.nodes[1]["register"]
    assert register["hostname"] == "sim-test-001"
    assert register["region"] == "test-1"
    assert register["labels"] == {"rack": "r12"}
    assert (register["cpu_cores"], register["ram_mib"], register["agent_version"]) == (96, 1048576, "0.1.0")
    assert [g["name"] for g in register["gpus"]] == [H100, H100]
    assert set(register["gpus"][0]) >= {"index", "uuid", "name", "memory_mib", "pci_bus_id", "nvlink_island"}
    credential = Path(config.state_dir) / "credential.json"
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert json.loads(credential.read_text())["node_id"] == 1

    heartbeat = portal.heartbeats[1][1]
    assert set(heartbeat) >= {"seq", "sent_at", "status", "samples", "workloads"}
    assert heartbeat["status"]["draining"] is False
    assert [s["gpu_uuid"] for s in heartbeat["samples"]] == [g["uuid"] for g in register["gpus"]]
    assert set(heartbeat["samples"][0]) >= {
        "ts",
        "util_pct",
        "mem_used_mib",
        "power_w",
        "temp_c",
        "sm_clock_mhz",
        "ecc_sbe",
        "ecc_dbe",
        "xid_errors",
        "throttle_reasons",
        "fell_off_bus",
        "processes",
    }
    sent = len(portal.seqs(1))

    # A restart re-uses the saved credential and goes on numbering where it stopped.
    second = run_agent(Agent(config))
    wait_for(lambda: len(portal.seqs(1)) >= sent + 3, what="heartbeats after the restart")
    second.stop()
    assert portal.register_calls == 1
    assert contiguous(portal.seqs(1))
    assert portal.duplicates == 0


def test_commands_run_once_even_when_delivered_twice(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    agent = Agent(make_config())
    starts: list[str] = []
    original_start = agent.runtime.start
    agent.runtime.start = lambda spec: (starts.append(spec.workload_id), original_start(spec))[1]
    thread = run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    uuid = portal.nodes[1]["register"]["gpus"][0]["uuid"]
    start = {
        "id": "c-start",
        "kind": "start_workload",
        "attempt": 1,
        "payload": {"workload_id": "42", "image": "x", "gpu_uuids": [uuid], "env": {}, "command": []},
    }
    # Delivered twice in one answer, and again later (the portal did not see the report in time).
    portal.queue_command(1, start)
    portal.queue_command(1, {**start, "attempt": 2})
    wait_for(lambda: "succeeded" in portal.reports_for("c-start"), what="the start to succeed")
    portal.queue_command(1, {**start, "attempt": 3})
    wait_for(lambda: portal.reports_for("c-start").count("succeeded") == 2, what="the stored result again")
    assert starts == ["42"]
    assert portal.reports_for("c-start") == ["accepted", "succeeded", "succeeded"]
    result = next(r for cid, status, r, _ in portal.reports if cid == "c-start" and status == "succeeded")
    assert result["workload_id"] == "42"

    # The workload shows in heartbeats with its GPU busy.
    def running_with_load() -> bool:
        body = portal.heartbeats[1][max(portal.seqs(1))]
        return any(w["workload_id"] == "42" and w["state"] == "running" for w in body["workloads"]) and (
            body["samples"][0]["util_pct"] > 80 and body["samples"][0]["processes"][0]["workload_id"] == "42"
        )

    wait_for(running_with_load, what="the workload in heartbeats")

    portal.queue_command(
        1, {"id": "c-pre", "kind": "preempt_workload", "payload": {"workload_id": "42", "notice_s": 0.2}}
    )
    wait_for(lambda: "succeeded" in portal.reports_for("c-pre"), what="the preemption")
    assert agent.runtime.get_status("42").state == "preempted"

    portal.queue_command(
        1,
        {
            "id": "c-bad",
            "kind": "start_workload",
            "payload": {"workload_id": "43", "gpu_uuids": ["GPU-elsewhere"]},
        },
    )
    portal.queue_command(1, {"id": "c-odd", "kind": "reboot_universe", "payload": {}})
    wait_for(
        lambda: "failed" in portal.reports_for("c-odd") and "failed" in portal.reports_for("c-bad"),
        what="failures",
    )
    portal.queue_command(1, {"id": "c-drain", "kind": "drain", "payload": {}})
    wait_for(lambda: "succeeded" in portal.reports_for("c-drain"), what="the drain")
    portal.queue_command(1, {"id": "c-late", "kind": "start_workload", "payload": {"workload_id": "44"}})
    wait_for(lambda: "failed" in portal.reports_for("c-late"), what="the refused start")
    messages = {cid: message for cid, status, _, message in portal.reports if status == "failed"}
    assert messages["c-bad"] == "GPU GPU-elsewhere is not on this node"
    assert messages["c-odd"] == "unknown command kind 'reboot_universe'"
    assert messages["c-late"] == "this node is draining and accepts no new work"
    wait_for(lambda: portal.heartbeats[1][max(portal.seqs(1))]["status"]["draining"], what="draining: true")
    thread.stop()
    assert thread.error is None


@pytest.mark.parametrize("outage", ["503", "server stopped"])
def test_portal_outage_loses_nothing_and_doubles_nothing(
    outage: str,
    portal: FakePortal,
    make_config: Callable[..., AgentConfig],
    run_agent: Callable[[Agent], AgentThread],
) -> None:
    agent = Agent(make_config(heartbeat_interval_s=0.05))
    thread = run_agent(agent)
    wait_for(lambda: len(portal.seqs(1)) >= 3, what="heartbeats before the outage")
    if outage == "503":
        portal.unavailable = True
    else:
        portal.stop()
    before = agent.heartbeats_built
    wait_for(lambda: agent.heartbeats_built >= before + 15, what="heartbeats built during the outage")
    during = len(portal.seqs(1))
    if outage == "503":
        portal.unavailable = False
    else:
        portal.start()  # the same port
    wait_for(lambda: len(portal.seqs(1)) >= during + 15, what="the buffer to drain")
    thread.stop()
    assert thread.error is None

    # Everything built arrived once, in order.
    assert contiguous(portal.seqs(1))
    arrived = [seq for node, seq in portal.arrivals if node == 1]
    assert arrived == sorted(arrived)
    with Buffer(Path(agent.config.state_dir) / "agent.sqlite3") as buffer:
        left = [item.body["seq"] for item in buffer.pending()]
        assert buffer.dead_letters() == []
    assert len(portal.seqs(1)) + len(left) == agent.heartbeats_built
    assert left == list(range(len(portal.seqs(1)) + 1, agent.heartbeats_built + 1))


def test_bad_batch_is_dead_lettered_and_the_queue_moves_on(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    portal.reject_seqs = {2}
    agent = Agent(make_config())
    thread = run_agent(agent)
    wait_for(lambda: len(portal.seqs(1)) >= 5, what="heartbeats after the bad one")
    thread.stop()
    assert portal.seqs(1)[:4] == [1, 3, 4, 5]
    with Buffer(Path(agent.config.state_dir) / "agent.sqlite3") as buffer:
        (dead,) = buffer.dead_letters()
    assert (dead["kind"], dead["key"], dead["status_code"]) == ("heartbeat", "2", 400)
    assert "batch 2 is malformed" in dead["error"]


def test_revoked_credential_registers_again_with_the_bootstrap_token(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    token = portal.add_token("gpb_9_reusable")
    thread = run_agent(Agent(make_config(bootstrap_token=token)))
    wait_for(lambda: len(portal.seqs(1)) >= 2, what="heartbeats")
    portal.tokens[token] = False  # staff issued the token again
    portal.revoke(1)
    count = len(portal.seqs(1))
    wait_for(lambda: len(portal.seqs(1)) >= count + 3, what="heartbeats with the new credential")
    thread.stop()
    assert portal.register_calls == 2
    assert contiguous(portal.seqs(1))  # the same node id: numbering goes on


def test_revoked_credential_without_a_token_stops_with_a_clear_error(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    config = make_config()
    thread = run_agent(Agent(config))
    wait_for(lambda: portal.seqs(1), what="registration")
    thread.stop()
    portal.revoke(1)
    config.bootstrap_token = ""
    again = run_agent(Agent(config))
    again.thread.join(10)
    assert isinstance(again.error, FatalAgentError)
    assert "rejected this node's credential (401) and no bootstrap token is configured" in str(again.error)


def test_without_credential_or_token_the_agent_refuses_to_start(
    make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    thread = run_agent(Agent(make_config(bootstrap_token="")))
    thread.thread.join(10)
    assert isinstance(thread.error, FatalAgentError)
    assert "no bootstrap token configured" in str(thread.error)


def test_a_refused_bootstrap_token_is_fatal(
    make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    thread = run_agent(Agent(make_config(bootstrap_token="gpb_0_wrong")))
    thread.thread.join(10)
    assert isinstance(thread.error, FatalAgentError)
    assert "refused to register this node: 401 invalid_token" in str(thread.error)


def test_registration_waits_for_the_portal(
    tmp_path: Path, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    later = FakePortal()
    later.start()
    url, token = later.url, later.add_token()
    later.stop()  # nothing listens on this port yet
    thread = run_agent(Agent(make_config(portal_url=url, bootstrap_token=token)))
    try:
        later.start()
        wait_for(lambda: later.seqs(1), what="registration once the portal is up")
    finally:
        thread.stop()
        later.stop()
    assert later.register_calls == 1


def test_readings_every_sample_interval_are_batched_every_heartbeat_interval(
    portal: FakePortal, make_config: Callable[..., AgentConfig], run_agent: Callable[[Agent], AgentThread]
) -> None:
    """DCGM-style: the GPUs are read every sample_interval_s and each batch carries every reading
    since the last one; none is lost or sent twice at a batch boundary or at shutdown."""
    from datetime import datetime

    agent = Agent(make_config(sample_interval_s=0.05, heartbeat_interval_s=0.4))
    thread = run_agent(agent)
    wait_for(lambda: len(portal.seqs(1)) >= 4, what="four batches")
    thread.stop()
    assert thread.error is None
    stopped_at = time.time()

    batches = [portal.heartbeats[1][seq] for seq in portal.seqs(1)]
    assert contiguous(portal.seqs(1))
    per_batch = [len({s["ts"] for s in b["samples"]}) for b in batches[1:-1]]
    assert all(5 <= n <= 9 for n in per_batch), per_batch  # about 0.4 / 0.05 readings
    for b in batches:
        assert len(b["samples"]) == 2 * len({s["ts"] for s in b["samples"]})  # both GPUs each time
    uuid = batches[0]["samples"][0]["gpu_uuid"]
    times = [
        datetime.fromisoformat(s["ts"]).timestamp()
        for b in batches
        for s in b["samples"]
        if s["gpu_uuid"] == uuid
    ]
    assert times == sorted(set(times))  # in order, none twice
    steps = [b - a for a, b in itertools.pairwise(times)]
    assert max(steps) < 0.3, steps  # none missing between batches
    assert stopped_at - times[-1] < 0.5  # the readings since the last batch went in a final one


def test_a_collector_that_never_blocks_is_sampled_on_the_event_loop(
    make_config: Callable[..., AgentConfig], monkeypatch
) -> None:
    """The simulated collector (``sample_blocks = False``) costs no thread hop per reading; a real
    one (NVML, AMD SMI) is read on a worker thread so that a slow driver never stalls the loop."""
    import asyncio
    import threading

    agent = Agent(make_config())
    assert agent.collector.sample_blocks is False
    threads: list[str] = []
    original = agent.collector.sample
    monkeypatch.setattr(
        agent.collector,
        "sample",
        lambda now: (threads.append(threading.current_thread().name), original(now))[1],
    )

    async def both() -> tuple[int, int]:
        on_loop = await agent.take_sample()
        monkeypatch.setattr(agent.collector, "sample_blocks", True, raising=False)
        return on_loop, await agent.take_sample()

    counts = asyncio.run(both())
    assert counts[0] == counts[1] > 0
    assert threads[0] == threading.current_thread().name and threads[1] != threads[0]


def test_a_runtime_that_never_blocks_is_asked_on_the_event_loop(
    make_config: Callable[..., AgentConfig], monkeypatch
) -> None:
    """The simulated runtime (``status_blocks = False``) answers from memory, on the loop; Docker
    and the process runtime are asked on a worker thread."""
    import asyncio
    import threading

    agent = Agent(make_config())
    assert agent.runtime.status_blocks is False
    threads: list[str] = []
    original = agent.runtime.status
    monkeypatch.setattr(
        agent.runtime, "status", lambda: (threads.append(threading.current_thread().name), original())[1]
    )

    async def both() -> None:
        await agent._runtime_status()
        monkeypatch.setattr(agent.runtime, "status_blocks", True)
        await agent._runtime_status()

    asyncio.run(both())
    assert threads[0] == threading.current_thread().name and threads[1] != threads[0]


def test_the_stop_event_ends_a_sleep_at_its_time_or_when_set_even_from_another_thread() -> None:
    """``StopEvent.sleep`` (the agent's sleeps between readings and after failures): a timer and a
    future, no task per sleep; ``set`` ends every sleep at once, also when called from another
    thread (``Agent.request_stop`` from a signal handler or the fleet)."""
    import asyncio
    import threading

    from nodes.agent.agent import StopEvent

    async def scenario() -> tuple[bool, float, int, list[bool], float, bool, int]:
        stop = StopEvent()
        started = time.monotonic()
        timed_out = await stop.sleep(0.05)
        slept = time.monotonic() - started
        loop = asyncio.get_running_loop()
        sleepers = [asyncio.ensure_future(stop.sleep(30)) for _ in range(3)]
        await asyncio.sleep(0.01)
        tasks = len(asyncio.all_tasks())  # this one and the three sleepers, nothing started by them
        started = time.monotonic()
        threading.Timer(0.05, loop.call_soon_threadsafe, [stop.set]).start()
        woken = await asyncio.wait_for(asyncio.gather(*sleepers), timeout=5)
        cut_short = time.monotonic() - started
        after = await stop.sleep(30)  # already set: no wait at all
        return timed_out, slept, tasks, woken, cut_short, after, len(stop._sleepers)

    timed_out, slept, tasks, woken, cut_short, after, left = asyncio.run(scenario())
    assert timed_out is False and 0.04 <= slept < 1
    assert tasks == 4
    assert woken == [True, True, True] and cut_short < 1
    assert after is True and left == 0
