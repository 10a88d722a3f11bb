from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodes.agent.agent import Agent
from nodes.agent.config import AgentConfig
from tests.agent.fakeportal import FakePortal
from tests.docker_engine import docker_engine  # noqa: F401  (the real engine, for the docker runtime)

H100 = "NVIDIA H100 80GB HBM3"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def portal() -> Iterator[FakePortal]:
    with FakePortal(heartbeat_interval_s=0.1, commands_wait_s=1) as fake:
        yield fake


@pytest.fixture
def make_config(tmp_path: Path, portal: FakePortal) -> Callable[..., AgentConfig]:
    def make(**overrides: Any) -> AgentConfig:
        values: dict[str, Any] = {
            "portal_url": portal.url,
            "allow_insecure_http": True,  # the fake portal listens on loopback
            "bootstrap_token": portal.add_token(),
            "state_dir": str(tmp_path / "state"),
            "collector": "simulated",
            "runtime": "simulated",
            "hostname": "sim-test-001",
            "region": "test-1",
            "sim_gpus": [{"model": H100, "count": 2}],
            "backoff_initial_s": 0.02,
            "backoff_max_s": 0.1,
            "request_timeout_s": 2.0,
            "shutdown_flush_s": 2.0,
            "stop_grace_s": 1.0,
        }
        values.update(overrides)
        return AgentConfig(**values)

    return make


class AgentThread:
    """An agent running its event loop in a thread, as the CLI would run it in a process."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.agent.run())
        except BaseException as exc:
            self.error = exc

    def start(self) -> AgentThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.agent.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the agent did not stop"


@pytest.fixture
def run_agent() -> Iterator[Callable[[Agent], AgentThread]]:
    running: list[AgentThread] = []

    def start(agent: Agent) -> AgentThread:
        thread = AgentThread(agent).start()
        running.append(thread)
        return thread

    yield start
    for thread in running:
        with contextlib.suppress(AssertionError):
            thread.stop()


@pytest.fixture
def process_options() -> Iterator[dict[str, Any]]:
    """Settings that let the subprocess runtime run: a single-tenant node, and when the tests run as
    root, workloads as ``nobody``. Their directories are outside pytest's (0700) temporary tree,
    which ``nobody`` could not enter; their commands are /bin/sh and coreutils for the same reason
    (this interpreter may live under /root)."""
    work_dir = tempfile.mkdtemp(prefix="gpupool-process-")
    yield {
        "single_tenant": True,
        "process_user": "nobody" if os.geteuid() == 0 else "",
        "process_work_dir": work_dir,
    }
    shutil.rmtree(work_dir, ignore_errors=True)
