"""Workload output capture: each runtime's ``output`` (real processes, the real Docker Engine with
the local busybox image, the simulated runtime), and the shipper's on-disk bound, backpressure,
rate limit and dropped-lines marker, on the real buffer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from nodes.agent.buffer import Buffer
from nodes.agent.logship import LINE_MAX_CHARS, LogLimits, LogShipper
from nodes.agent.runtimes.docker import docker_since
from nodes.agent.runtimes.process import SubprocessRuntime
from nodes.agent.runtimes.simulated import SIM_LOG_EVERY_S, SimulatedRuntime
from nodes.agent.types import WorkloadSpec
from tests.agent.conftest import wait_for
from tests.agent.test_docker_runtime import finished, new_id, runtime, runtimes, spec  # noqa: F401
from tests.agent.test_subprocess_runtime import done, sh

SH = "/bin/sh"


@pytest.fixture
def processes(tmp_path: Path, process_options: dict[str, Any]):
    made = SubprocessRuntime(tmp_path / "state", **process_options)
    yield made
    for status in made.status():
        if not status.terminal:
            made.stop(status.workload_id, grace_s=0.5)


def read_all(source, workload_id: str, cursor=None, limit: int = 10_000):
    lines, cursor = source.output(workload_id, cursor or {}, limit)
    return [(stream, text) for _, stream, text in lines], cursor


def queued(buffer: Buffer) -> list[tuple[str, str, str]]:
    return buffer.db.execute("SELECT workload_id, stream, text FROM log_lines ORDER BY id").fetchall()


# --- the runtimes ------------------------------------------------------------------------------------


def test_process_output_is_read_per_stream_from_its_pipes_once(processes: SubprocessRuntime) -> None:
    processes.start(
        WorkloadSpec(
            "p1",
            command=sh(
                "trap 'echo three; printf tail; exit 0' TERM; echo one; echo oops >&2; echo two; sleep 30 & wait"
            ),
        )
    )
    got = wait_for(lambda: (r := read_all(processes, "p1")) and len(r[0]) == 3 and r, what="three lines")
    lines, cursor = got
    assert sorted(lines) == [("stderr", "oops"), ("stdout", "one"), ("stdout", "two")]
    assert read_all(processes, "p1", cursor)[0] == []  # nothing new: nothing again
    processes.stop("p1", grace_s=5)  # its TERM trap writes the rest
    done(processes, "p1")
    rest, cursor = read_all(processes, "p1", cursor)
    # The unfinished last line ("tail", no newline) comes once the process has ended.
    assert rest == [("stdout", "three"), ("stdout", "tail")]
    assert read_all(processes, "p1", cursor)[0] == []


def test_process_output_respects_the_limit_and_goes_on_from_the_cursor(processes: SubprocessRuntime) -> None:
    processes.start(
        WorkloadSpec("p2", command=sh("i=0; while [ $i -lt 50 ]; do echo line $i; i=$((i+1)); done"))
    )
    done(processes, "p2")
    first, cursor = read_all(processes, "p2", limit=20)
    second, cursor = read_all(processes, "p2", cursor, limit=100)
    assert [t for _, t in first + second] == [f"line {i}" for i in range(50)]


def test_docker_output_is_the_containers_streams_with_their_times(runtime, new_id) -> None:  # noqa: F811
    wid = new_id()
    runtime.start(
        spec(wid, "sh", "-c", "echo warn >&2; for i in 1 2 3; do echo epoch $i; done; sleep 2; echo late")
    )
    wait_for(lambda: len(read_all(runtime, wid)[0]) == 4, what="four lines")
    lines, cursor = runtime.output(wid, {}, 100)
    assert sorted((s, t) for _, s, t in lines) == [
        ("stderr", "warn"), ("stdout", "epoch 1"), ("stdout", "epoch 2"), ("stdout", "epoch 3"),
    ]  # fmt: skip
    assert all(abs(at - lines[0][0]) < 5 and at > 1.7e9 for at, _, _ in lines)  # the engine's times
    assert runtime.output(wid, cursor, 100)[0] == []  # asked again: nothing twice
    finished(runtime, wid)
    late, cursor = runtime.output(wid, cursor, 100)
    assert [(s, t) for _, s, t in late] == [("stdout", "late")]
    # A limit: at most that many, and the rest later.
    first, partial = runtime.output(wid, {}, 2)
    rest, _ = runtime.output(wid, partial, 100)
    assert len(first) == 2 and len(first) + len(rest) == 5


def test_docker_output_of_a_fast_writer_is_every_line_once_in_order(
    runtime,  # noqa: F811
    new_id,  # noqa: F811
    docker_engine,
) -> None:
    count = 10_000
    wid = new_id()
    runtime.start(
        spec(
            wid,
            "sh",
            "-c",
            f"i=0; while [ $i -lt {count} ]; do echo out $i; echo err $i >&2; i=$((i+1)); done",
        )
    )
    got: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
    cursor: dict = {}
    polls = 0
    while True:
        status = runtime.get_status(wid)
        ended = status is not None and status.terminal
        lines, cursor = runtime.output(wid, cursor, 997)  # cuts inside a second, maybe a microsecond
        for at, stream, text in lines:
            got[stream].append((at, text))
        polls += 1
        if ended and not lines:
            break
    assert [t for _, t in got["stdout"]] == [f"out {i}" for i in range(count)]
    assert [t for _, t in got["stderr"]] == [f"err {i}" for i in range(count)]
    assert polls > 2 * count // 997
    # Each poll asks the engine only from the last line sent on: the boundary's microsecond, not
    # its second. Positive control: from the time of the 100th line before the end, 100 lines.
    name = f"gpupool-{wid}"
    stamps = [round(at * 1e9) for at, _ in got["stdout"]]

    def lines_since(ns: int) -> int:
        return docker_engine.api.logs(name, stdout=True, stderr=False, since=docker_since(ns)).count(b"\n")

    assert 100 <= lines_since(stamps[-100]) <= 103
    assert 1 <= lines_since(stamps[-1]) <= 3


def test_simulated_runtime_writes_lines_labelled_as_simulated(tmp_path: Path) -> None:
    now = [1_000.0]
    sim = SimulatedRuntime(tmp_path, clock=lambda: now[0], cold_start_s=0)
    sim.start(WorkloadSpec("s1", gpu_uuids=["GPU-a"], sim_duration_s=3 * SIM_LOG_EVERY_S + 1))
    lines, cursor = read_all(sim, "s1")
    assert lines == [("stdout", "[simulated] workload s1 started on GPU-a")]
    now[0] += 10 * SIM_LOG_EVERY_S
    lines, cursor = read_all(sim, "s1", cursor)
    assert [t for _, t in lines] == [
        "[simulated] step 1: loss 0.5000",
        "[simulated] step 2: loss 0.3333",
        "[simulated] step 3: loss 0.2500",
        "[simulated] exited with exit code 0",
    ]
    assert read_all(sim, "s1", cursor)[0] == []


# --- the shipper --------------------------------------------------------------------------------------


def test_the_buffer_is_bounded_and_output_waits_at_its_source(tmp_path: Path, processes) -> None:
    buffer = Buffer(tmp_path / "agent.sqlite3")
    shipper = LogShipper(buffer, processes, LogLimits(lines_per_s=1e6, bytes_per_s=1e9, buffer_lines=100))
    processes.start(
        WorkloadSpec("b1", command=sh("i=0; while [ $i -lt 250 ]; do echo n $i; i=$((i+1)); done"))
    )
    done(processes, "b1")
    asyncio.run(shipper.collect(["b1"]))
    assert buffer.log_count() == 99  # one place is kept for a marker
    asyncio.run(shipper.collect(["b1"]))
    assert buffer.log_count() == 99 and shipper.backpressured == 1  # full: nothing read
    sent = []
    for _ in range(20):
        seq, body = buffer.log_batch(40)
        sent += [line[2] for w in json.loads(body)["workloads"] for line in w["lines"]]
        buffer.log_ack(seq)
        asyncio.run(shipper.collect(["b1"]))
        if len(sent) >= 250:
            break
    # Nothing lost, nothing twice, in order, and the same batch is given again until it is acked.
    assert sent == [f"n {i}" for i in range(250)]
    asyncio.run(shipper.collect(["b1"]))
    assert buffer.log_batch(40) is None


def test_a_batch_is_the_same_batch_until_the_portal_takes_it(tmp_path: Path) -> None:
    buffer = Buffer(tmp_path / "agent.sqlite3")
    buffer.log_add("7", [(1.0, "stdout", "a"), (2.0, "stderr", "b")], "logcursor:7", "{}")
    first = buffer.log_batch(10)
    buffer.log_add("7", [(3.0, "stdout", "c")], "logcursor:7", "{}")
    assert buffer.log_batch(10) == first  # a retry sends the same seq and lines
    buffer.log_ack(first[0])
    seq, body = buffer.log_batch(10)
    assert seq == first[0] + 1 and '"c"' in body


def test_a_workload_over_its_limit_loses_lines_and_says_how_many(tmp_path: Path, processes) -> None:
    buffer = Buffer(tmp_path / "agent.sqlite3")
    now = [100.0]
    limits = LogLimits(lines_per_s=10, bytes_per_s=1e9, burst_s=1, buffer_lines=10_000)
    shipper = LogShipper(buffer, processes, limits, clock=lambda: now[0])
    processes.start(
        WorkloadSpec("r1", command=sh("i=0; while [ $i -lt 200 ]; do echo x $i; i=$((i+1)); done"))
    )
    done(processes, "r1")
    asyncio.run(shipper.collect(["r1"]))
    rows = queued(buffer)
    kept = [text for _, stream, text in rows if not text.startswith("[gpupool]")]
    assert kept == [f"x {i}" for i in range(10)]  # the burst, in order
    (marker,) = [(stream, text) for _, stream, text in rows if text.startswith("[gpupool]")]
    assert marker[0] == "stderr"
    assert marker[1].startswith("[gpupool] 190 lines dropped") and "10 lines/s" in marker[1]
    # Under its limit again: lines pass, with no marker.
    processes.start(WorkloadSpec("r2", command=sh("echo calm")))
    done(processes, "r2")
    now[0] += 1
    asyncio.run(shipper.collect(["r1", "r2"]))
    assert queued(buffer)[-1] == ("r2", "stdout", "calm")
    assert shipper.dropped == 190


def test_bytes_are_limited_too_and_lines_are_cut_and_cleaned(tmp_path: Path, processes) -> None:
    buffer = Buffer(tmp_path / "agent.sqlite3")
    limits = LogLimits(lines_per_s=1e6, bytes_per_s=10_000, burst_s=1, buffer_lines=10_000)
    shipper = LogShipper(buffer, processes, limits, clock=lambda: 5.0)
    long = "y" * 5000
    processes.start(
        WorkloadSpec("c1", command=sh(f"printf 'a\\000b\\n'; echo {long}; echo {long}; echo {long}"))
    )
    done(processes, "c1")
    asyncio.run(shipper.collect(["c1"]))
    texts = [text for _, _, text in queued(buffer)]
    assert texts[0] == "a\ufffdb"
    assert texts[1] == "y" * LINE_MAX_CHARS
    assert texts[2] == "y" * LINE_MAX_CHARS
    assert texts[3].startswith("[gpupool] 1 lines dropped")  # the third long line passed 10 kB
