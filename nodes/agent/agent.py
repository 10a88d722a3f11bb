"""The agent loop: register once, then heartbeats, the command long poll and the outbox sender.

It runs on asyncio: the network parts are coroutines that a shutdown can cancel at once; the
collector and the runtime (blocking calls: NVML, docker, processes) run in worker threads.
Everything the portal must receive goes through the on-disk buffer first (``buffer.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import zlib
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from nodes.agent import __version__
from nodes.agent.buffer import HEARTBEAT, Buffer, OutboxItem
from nodes.agent.client import (
    BAD,
    OK,
    REAUTH,
    RETRY,
    Backoff,
    PortalClient,
    PortalUnreachable,
    classify,
    error_text,
)
from nodes.agent.collectors import Collector, make_collector
from nodes.agent.commands import CommandHandlers
from nodes.agent.config import AgentConfig
from nodes.agent.logship import BATCH_MAX_LINES, LogLimits, LogShipper
from nodes.agent.mig import MigSlices
from nodes.agent.runtimes import Runtime, RuntimeFailure, make_runtime
from nodes.agent.types import (
    FAILED,
    GpuSample,
    NodeInventory,
    WorkloadStatus,
    rfc3339,
)
from nodes.agent.volumes import Volumes

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
MAX_BATCH_SAMPLES = 2000  # the portal's limit per batch (NODE_HEARTBEAT_MAX_SAMPLES)
DEFAULT_COMMANDS_WAIT_S = 25
MAX_COMMANDS_WAIT_S = 30
TERMINAL_REPORTS = 3  # a finished workload is reported in this many batches, then forgotten
LOG_TAIL_LINES = 20


class StopEvent(asyncio.Event):
    """The agent's stop flag, with a sleep that a stop cuts short.

    ``asyncio.wait_for(event.wait(), timeout)`` starts a task for every sleep: 22-25 us of CPU
    against 11-12 for a timer and a future, and a node's agent sleeps once a second between GPU
    readings (a fleet process of the simulated fleet, a hundred times a second)."""

    def __init__(self) -> None:
        super().__init__()
        self._sleepers: set[asyncio.Future[None]] = set()

    def set(self) -> None:
        super().set()
        for woken in self._sleepers:
            _wake(woken)

    async def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless the event is set first; True when it is set."""
        if self.is_set():
            return True
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(max(0.0, seconds), _wake, woken)
        self._sleepers.add(woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._sleepers.discard(woken)
        return self.is_set()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class FatalAgentError(RuntimeError):
    """The agent cannot go on (no valid credential and no way to get one, a refused registration)."""


def _ram_mib() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


def _host_uptime_s() -> float | None:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def write_private_json(path: Path, data: dict[str, Any]) -> None:
    """Write a file only its owner can read (0600), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class Agent(CommandHandlers):
    def __init__(
        self,
        config: AgentConfig,
        *,
        collector: Collector | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.config = config.validate()
        self.log = logging.LoggerAdapter(log, {})
        self.log.process = lambda msg, kwargs: (f"[{self.config.hostname}] {msg}", kwargs)  # type: ignore[method-assign]
        self.state_dir = config.state_path
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.state_dir, 0o700)
        self.credential_path = self.state_dir / "credential.json"
        self.runtime = runtime or make_runtime(
            config.runtime,
            self.state_dir,
            gpu_sharing=config.gpu_sharing,
            mps_pipe_dir=config.mps_pipe_dir,
            **config.runtime_options(),
        )
        self.runtime.volumes = Volumes(config.volumes_root)
        self.collector = collector or make_collector(
            config.collector,
            gpus=config.sim_gpus,
            hostname=config.hostname,
            seed=config.seed or zlib.crc32(config.hostname.encode()),
            interconnect=config.interconnect or "nvswitch",
            control_file=self.state_dir / "faults.json",
        )
        if hasattr(self.collector, "attach") and hasattr(self.runtime, "gpu_load"):
            self.collector.attach(self.runtime.gpu_load)
        self.buffer = Buffer(self.state_dir / "agent.sqlite3")
        self.inventory: NodeInventory | None = None
        self.node_id: int | None = None
        self.credential: str | None = None
        self.heartbeat_interval_s = config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S
        self.commands_wait_s = config.commands_wait_s or DEFAULT_COMMANDS_WAIT_S
        self.started = time.time()
        self._client: PortalClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: StopEvent | None = None
        self._stop_requested = False
        self._wake: asyncio.Event | None = None
        self._auth_lock: asyncio.Lock | None = None
        self._command_tasks: dict[str, asyncio.Task[None]] = {}
        self._terminal_seen: dict[str, int] = {}
        self._fail_messages: dict[str, str] = {}
        self.mig = MigSlices(self.buffer, self.collector, self.log)
        self.logship = LogShipper(
            self.buffer,
            self.runtime,
            LogLimits(
                lines_per_s=config.workload_log_lines_per_s,
                bytes_per_s=config.workload_log_bytes_per_s,
                burst_s=config.workload_log_burst_s,
                buffer_lines=config.workload_log_buffer_lines,
            ),
            log=self.log,
        )
        self.fatal: BaseException | None = None
        self.heartbeats_built = 0
        self._readings: list[GpuSample] = []  # sampled, not yet in a batch
        self.ssh: Any = None  # the SSH endpoint (nodes/agent/ssh.py) when ssh_listen is set
        self._ssh_announce: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the agent to shut down; safe from any thread and from signal handlers."""
        self._stop_requested = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop may close meanwhile
                loop.call_soon_threadsafe(stop.set)

    @property
    def stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    async def run(self) -> None:
        """Run until ``request_stop``; raises :class:`FatalAgentError` when it cannot go on."""
        self._loop = asyncio.get_running_loop()
        self._stop = StopEvent()
        self._wake = asyncio.Event()
        self._auth_lock = asyncio.Lock()
        if self._stop_requested:
            self._stop.set()
        self._client = PortalClient(self.config.portal_url, self.config.request_timeout_s)
        tasks: list[asyncio.Task[None]] = []
        try:
            self.inventory = await asyncio.to_thread(self.collector.discover)
            self.runtime.node_gpus = len(self.inventory.gpus)
            self.runtime.inventory = self.inventory
            self.log.info(
                "collector %s found %d GPU(s); runtime %s",
                self.collector.name,
                len(self.inventory.gpus),
                self.runtime.name,
            )
            if self.config.ssh_listen:
                from nodes.agent.ssh import SshEndpoint

                self.ssh = SshEndpoint(
                    listen=self.config.ssh_listen,
                    state_dir=self.state_dir,
                    runtime=self.runtime,
                    keys=self.ssh_keys,
                    recheck_s=self.config.ssh_recheck_s,
                )
                await self.ssh.start()
            self._load_credential()
            if self.credential is None:
                await self._register(initial=True)
            else:
                self._announce_ssh()
            if not self.stopping:
                tasks = [
                    self._spawn(self._heartbeat_loop(), "heartbeats"),
                    self._spawn(self._sender_loop(), "sender"),
                    self._spawn(self._poll_loop(), "commands"),
                    self._spawn(self._logs_loop(), "logs"),
                ]
                await self._stop.wait()
        finally:
            await self._shutdown(tasks)
        if self.fatal is not None:
            raise FatalAgentError(str(self.fatal)) from self.fatal

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.config.hostname}:{name}")
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            if not isinstance(exc, FatalAgentError):
                self.log.error("%s crashed: %r", task.get_name(), exc, exc_info=exc)
            self.fatal = self.fatal or exc
            assert self._stop is not None
            self._stop.set()

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        assert self._stop is not None
        self._stop.set()
        if self._ssh_announce is not None:
            tasks = [*tasks, self._ssh_announce]
        if self.ssh is not None:
            await self.ssh.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._readings and self.credential is not None:
            # Readings taken since the last batch: into one last batch, kept in the buffer.
            with contextlib.suppress(Exception):
                await self.build_heartbeat(sample=False)
        deadline = time.monotonic() + self.config.shutdown_flush_s
        running = [task for task in self._command_tasks.values() if not task.done()]
        if running:
            await asyncio.wait(running, timeout=self.config.shutdown_flush_s / 2)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if self.credential is not None and self.fatal is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush(), timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.send_logs(reauth=False), timeout=max(0.1, deadline - time.monotonic())
                )
        left = self.buffer.count()
        if left:
            self.log.info("shutting down with %d item(s) kept in the buffer for the next start", left)
        assert self._client is not None
        await self._client.close()
        await asyncio.to_thread(self.collector.close)
        self.buffer.close()
        self.log.info("stopped")

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless a stop comes first; True when stopping."""
        assert self._stop is not None
        return await self._stop.sleep(seconds)

    # -- registration -----------------------------------------------------------------------------

    def _load_credential(self) -> None:
        if not self.credential_path.exists():
            return
        data = json.loads(self.credential_path.read_text())
        self.node_id = int(data["node_id"])
        self.credential = str(data["credential"])
        self._apply_intervals(data)
        self.log.info("using the saved credential of node %s", self.node_id)

    def _apply_intervals(self, data: dict[str, Any]) -> None:
        if self.config.heartbeat_interval_s is None and data.get("heartbeat_interval_s"):
            self.heartbeat_interval_s = float(data["heartbeat_interval_s"])
        if self.config.commands_wait_s is None and data.get("commands_wait_s"):
            self.commands_wait_s = min(MAX_COMMANDS_WAIT_S, int(data["commands_wait_s"]))

    def register_body(self) -> dict[str, Any]:
        inventory = self.inventory or NodeInventory(gpus=[])
        body: dict[str, Any] = {
            "bootstrap_token": self.config.bootstrap_token,
            "hostname": self.config.hostname,
            "labels": self.config.labels,
            "cpu_cores": self.config.cpu_cores or os.cpu_count() or 0,
            "ram_mib": self.config.ram_mib or _ram_mib(),
            "driver_version": inventory.driver_version,
            "cuda_version": inventory.cuda_version,
            "rocm_version": inventory.rocm_version,
            "level_zero_version": inventory.level_zero_version,
            "agent_version": __version__,
            "interconnect": self.config.interconnect or inventory.interconnect,
            "gpus": [gpu.to_json() for gpu in inventory.gpus],
        }
        if self.config.region:
            body["region"] = self.config.region
        if self.config.advertise_address:
            body["address"] = self.config.advertise_address
        return body

    async def _register(self, *, initial: bool) -> None:
        """Trade the bootstrap token for a node credential; retries while the portal is away."""
        if not self.config.bootstrap_token:
            if initial:
                raise FatalAgentError(
                    f"no node credential in {self.state_dir} and no bootstrap token configured "
                    "(GPUPOOL_BOOTSTRAP_TOKEN or --bootstrap-token)"
                )
            raise FatalAgentError(
                "the portal rejected this node's credential (401) and no bootstrap token is configured "
                "to register again; give the agent a new bootstrap token"
            )
        assert self._client is not None
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self.stopping:
            try:
                response = await self._client.request("POST", "/agent/v1/register", json=self.register_body())
            except PortalUnreachable as exc:
                delay = backoff.next()
                self.log.warning("register: portal unreachable (%s); retrying in %.1f s", exc, delay)
                await self._sleep(delay)
                continue
            outcome = classify(response.status_code)
            if outcome == OK:
                data = response.json()
                previous = self.node_id
                self.node_id = int(data["node_id"])
                self.credential = str(data["credential"])
                self._apply_intervals(data)
                write_private_json(
                    self.credential_path,
                    {
                        "node_id": self.node_id,
                        "credential": self.credential,
                        "heartbeat_interval_s": data.get("heartbeat_interval_s"),
                        "commands_wait_s": data.get("commands_wait_s"),
                        "portal_url": self.config.portal_url,
                        "hostname": self.config.hostname,
                    },
                )
                if previous is not None and previous != self.node_id:
                    self.log.warning("the portal gave a new node id %s (was %s)", self.node_id, previous)
                    self.buffer.renumber_heartbeats()
                self.log.info("registered as node %s", self.node_id)
                self._announce_ssh()
                return
            if outcome == RETRY:
                delay = backoff.next()
                self.log.warning("register: %s; retrying in %.1f s", error_text(response), delay)
                await self._sleep(delay)
                continue
            raise FatalAgentError(f"the portal refused to register this node: {error_text(response)}")

    async def _reauthenticate(self, rejected: str | None) -> None:
        assert self._auth_lock is not None
        async with self._auth_lock:
            if self.credential != rejected:
                return  # another task already registered again
            self.log.warning("the portal rejected the node credential (401); registering again")
            await self._register(initial=False)

    # -- the SSH endpoint -------------------------------------------------------------------------

    def _announce_ssh(self) -> None:
        """Tell the portal (in the background, until it has heard) where this node's SSH endpoint
        listens and its host key, or that there is none: at every start, after registering."""
        if self._ssh_announce is not None:
            self._ssh_announce.cancel()
        self._ssh_announce = asyncio.ensure_future(self._announce_ssh_until_heard())

    async def _announce_ssh_until_heard(self) -> None:
        assert self._client is not None
        body: dict[str, Any] = {"port": None}
        if self.ssh is not None:
            body = {"port": self.ssh.port, "host_key": self.ssh.public_host_key}
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self.stopping:
            credential = self.credential
            try:
                response = await self._client.request(
                    "PUT", f"/agent/v1/nodes/{self.node_id}/ssh-endpoint", credential=credential, json=body
                )
            except PortalUnreachable:
                await self._sleep(backoff.next())
                continue
            outcome = classify(response.status_code)
            if outcome == OK:
                return
            if outcome == BAD:
                self.log.error("the portal refused the SSH endpoint: %s", error_text(response))
                return
            if outcome == REAUTH:
                await self._reauthenticate(credential)
                return  # registering again announces again
            await self._sleep(backoff.next())

    async def ssh_keys(self, workload_id: str) -> list[str] | None:
        """The public keys that may log in to ``workload_id`` now, as the portal answers at this
        moment: an empty list when it says the workload does not run here (404), None when it
        cannot be asked or answers anything else. Nobody logs in on either; open sessions are
        closed on the first only (``SshEndpoint.recheck``)."""
        if self._client is None or self.credential is None:
            return None
        try:
            response = await self._client.request(
                "GET",
                f"/agent/v1/nodes/{self.node_id}/workloads/{workload_id}/ssh-keys",
                credential=self.credential,
            )
        except PortalUnreachable as exc:
            self.log.warning("SSH login to %s refused: the portal is unreachable (%s)", workload_id, exc)
            return None
        if response.status_code == 404:
            return []
        if response.status_code != 200:
            self.log.info("SSH login to %s refused: %s", workload_id, error_text(response))
            return None
        keys = response.json().get("keys")
        if not isinstance(keys, list):
            return None
        return [k["key"] for k in keys if isinstance(k, dict) and isinstance(k.get("key"), str)]

    # -- heartbeats -------------------------------------------------------------------------------

    @property
    def sample_interval_s(self) -> float:
        return min(self.config.sample_interval_s, self.heartbeat_interval_s)

    async def _heartbeat_loop(self) -> None:
        """Read the GPUs every ``sample_interval_s``; every ``heartbeat_interval_s`` put the readings
        since the last batch into a new batch (DCGM-style 1 Hz telemetry sent every 10 s)."""
        loop = asyncio.get_running_loop()
        if self.config.heartbeat_phase and await self._sleep(
            self.config.heartbeat_phase * self.heartbeat_interval_s
        ):
            return
        next_sample = next_batch = loop.time()
        while not self.stopping:
            if loop.time() >= next_batch - 1e-3:
                await self.build_heartbeat()
                next_batch = max(next_batch + self.heartbeat_interval_s, loop.time())
            else:
                await self.take_sample()
            # After a slow sample, do not try to catch up; never sample past the batch's time.
            next_sample = max(next_sample + self.sample_interval_s, loop.time())
            next_sample = min(next_sample, next_batch)
            if await self._sleep(next_sample - loop.time()):
                return

    async def _runtime_status(self) -> list[WorkloadStatus]:
        try:
            if not self.runtime.status_blocks:
                return self.runtime.status()
            return await asyncio.to_thread(self.runtime.status)
        except RuntimeFailure as exc:
            self.log.error("runtime status failed: %s", exc)
            return []

    async def take_sample(self) -> int:
        """Read every GPU once and keep the readings for the next batch; returns how many."""
        now = time.time()
        try:
            if getattr(self.collector, "sample_blocks", True):
                samples = await asyncio.to_thread(self.collector.sample, now)
            else:
                samples = self.collector.sample(now)
        except Exception as exc:  # a collector failure must not stop the heartbeats
            self.log.error("collector sample failed: %r", exc)
            samples = []
        if len(self._readings) + len(samples) > MAX_BATCH_SAMPLES:
            await self.build_heartbeat(sample=False)  # the portal takes at most this many at once
        self._readings.extend(samples)
        return len(samples)

    async def build_heartbeat(self, *, sample: bool = True) -> int:
        """Read the GPUs (unless ``sample`` is false), queue one numbered batch with every reading
        since the last batch in the buffer, wake the sender; returns its seq."""
        if sample:
            await self.take_sample()
        now = time.time()
        samples, self._readings = self._readings, []
        statuses = await self._runtime_status()
        await self._enforce_max_runtime(statuses, now)
        # Before the portal hears that a workload ended (and may give its GPU to other work), the
        # MIG slice it ran on is gone.
        if await self.mig.release_finished(statuses):
            self.inventory = await asyncio.to_thread(self.collector.discover)
        for reading in samples:
            for process in reading.processes:
                if process.workload_id is None:
                    process.workload_id = self.runtime.workload_for_pid(process.pid)
        workloads = []
        for status in statuses:
            if status.state == FAILED and not status.message:
                status.message = await self._failure_message(status.workload_id)
            workloads.append(status.to_json())
        uptime = None if self.collector.name == "simulated" else _host_uptime_s()
        body = {
            "sent_at": rfc3339(now),
            "status": {
                "uptime_s": round(uptime if uptime is not None else now - self.started, 1),
                "load_1m": round(os.getloadavg()[0], 2),
                "agent_version": __version__,
                "draining": self.draining,
                "gang_network": self.runtime.gang_network,
            },
            "samples": [reading.to_json() for reading in samples],
            "workloads": workloads,
        }
        if self.inventory is not None:
            # Every batch: the portal writes them only when they differ from what it holds.
            body["versions"] = self.inventory.versions()
        active = {status.workload_id for status in statuses if not status.terminal}
        # Measuring reads the disk, so in a thread; an idle node's agent skips the hop.
        volumes = (
            [] if self.runtime.volumes.idle else await asyncio.to_thread(self.runtime.volumes.report, active)
        )
        if volumes:
            body["volumes"] = volumes
        seq = self.buffer.add_heartbeat(body)
        self.heartbeats_built += 1
        await self._forget_reported(statuses)
        self._wake_sender()
        return seq

    async def _failure_message(self, workload_id: str) -> str:
        if workload_id not in self._fail_messages:
            try:
                tail = await asyncio.to_thread(self.runtime.logs, workload_id, LOG_TAIL_LINES)
            except RuntimeFailure as exc:
                tail = f"(logs unavailable: {exc})"
            self._fail_messages[workload_id] = tail[-2000:]
        return self._fail_messages[workload_id]

    async def _forget_reported(self, statuses: list[WorkloadStatus]) -> None:
        for status in statuses:
            if not status.terminal:
                continue
            seen = self._terminal_seen.get(status.workload_id, 0) + 1
            self._terminal_seen[status.workload_id] = seen
            if seen >= TERMINAL_REPORTS:
                await self.forget_ended(status.workload_id)

    async def forget_ended(self, workload_id: str) -> None:
        """Drop an ended workload's record, after shipping its last lines."""
        await self.logship.collect_one(workload_id)
        await asyncio.to_thread(self.runtime.forget, workload_id)
        self._terminal_seen.pop(workload_id, None)
        self._fail_messages.pop(workload_id, None)

    def _deadlines(self) -> dict[str, float]:
        return json.loads(self.buffer.get("deadlines", "{}") or "{}")

    async def _enforce_max_runtime(self, statuses: list[WorkloadStatus], now: float) -> None:
        deadlines = self._deadlines()
        if not deadlines:
            return
        known = {status.workload_id: status for status in statuses}
        for workload_id, deadline in list(deadlines.items()):
            status = known.get(workload_id)
            if status is None or status.terminal:
                deadlines.pop(workload_id)
            elif now >= deadline:
                self.log.info("workload %s passed its max_runtime_s; stopping it", workload_id)
                await asyncio.to_thread(self.runtime.stop, workload_id, self.config.stop_grace_s)
                deadlines.pop(workload_id)
        self.buffer.set("deadlines", json.dumps(deadlines))

    @property
    def draining(self) -> bool:
        return self.buffer.get("draining") == "1"

    # -- the outbox sender ------------------------------------------------------------------------

    def _wake_sender(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _sender_loop(self) -> None:
        assert self._wake is not None
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self.stopping:
            self._wake.clear()
            item = self.buffer.peek()
            if item is None:
                # Whatever queues an item wakes this; a stop cancels the task.
                await self._wake.wait()
                continue
            outcome = await self._send(item)
            if outcome == OK:
                backoff.reset()
            elif outcome == RETRY:
                await self._sleep(backoff.next())

    async def _flush(self) -> None:
        """At shutdown: send what the portal takes now; stop at the first failure."""
        while (item := self.buffer.peek()) is not None:
            if await self._send(item, reauth=False) != OK:
                return

    async def _send(self, item: OutboxItem, *, reauth: bool = True) -> str:
        assert self._client is not None
        if item.kind == HEARTBEAT:
            path = f"/agent/v1/nodes/{self.node_id}/heartbeat"
        else:
            path = f"/agent/v1/nodes/{self.node_id}/commands/{item.key}/report"
        credential = self.credential
        try:
            # The stored JSON as it is: no parse and re-encode of 80 samples per heartbeat.
            response = await self._client.request("POST", path, credential=credential, content=item.raw)
        except PortalUnreachable as exc:
            self.buffer.note_failure(item.id, str(exc))
            self.log.warning("portal unreachable (%s); %d item(s) buffered", exc, self.buffer.count())
            return RETRY
        outcome = classify(response.status_code)
        if outcome == OK:
            self.buffer.ack(item.id)
            if item.kind == HEARTBEAT:
                self._check_heartbeat_answer(item, response.json() if response.content else {})
        elif outcome == RETRY:
            self.buffer.note_failure(item.id, error_text(response))
            self.log.warning(
                "portal answered %s; %d item(s) buffered", error_text(response), self.buffer.count()
            )
        elif outcome == BAD:
            self.log.error("the portal refused %s %s as bad: %s", item.kind, item.key, error_text(response))
            self.buffer.dead_letter(item, response.status_code, error_text(response))
        elif outcome == REAUTH:
            if not reauth:
                return RETRY
            await self._reauthenticate(credential)
        return outcome

    def _check_heartbeat_answer(self, item: OutboxItem, data: dict[str, Any]) -> None:
        status = data.get("status")
        if status not in ("accepted", "duplicate"):
            self.log.warning("heartbeat %s answered with status %r", item.key, status)
        if data.get("gap"):
            self.log.info("the portal misses heartbeats %s", data["gap"])

    # -- workload logs ----------------------------------------------------------------------------

    async def _logs_loop(self) -> None:
        """Read the workloads' output into the buffer, send what waits; every log interval."""
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self.stopping:
            statuses = await self._runtime_status()
            await self.logship.collect([status.workload_id for status in statuses])
            outcome = await self.send_logs()
            delay = backoff.next() if outcome == RETRY else self.config.workload_log_interval_s
            if outcome != RETRY:
                backoff.reset()
            if await self._sleep(delay):
                return

    async def send_logs(self, *, reauth: bool = True) -> str:
        """Send log batches until none waits or one fails; the outcome of the last one."""
        assert self._client is not None
        while (batch := self.buffer.log_batch(BATCH_MAX_LINES)) is not None:
            seq, body = batch
            credential = self.credential
            try:
                response = await self._client.request(
                    "POST", f"/agent/v1/nodes/{self.node_id}/logs", credential=credential, content=body
                )
            except PortalUnreachable as exc:
                self.log.debug("logs: portal unreachable (%s)", exc)
                return RETRY
            outcome = classify(response.status_code)
            if outcome == OK:
                self.buffer.log_ack(seq)
                refused = (response.json() if response.content else {}).get("refused")
                if refused:
                    self.log.warning("the portal refused the output of workloads %s", refused)
            elif outcome == BAD:
                self.log.error("the portal refused log batch %s as bad: %s", seq, error_text(response))
                self.buffer.log_ack(seq)  # it would be refused again; the lines are dropped
            elif outcome == REAUTH:
                if reauth:
                    await self._reauthenticate(credential)
                return RETRY
            else:
                self.log.warning("logs: portal answered %s", error_text(response))
                return RETRY
        return OK

    # -- commands ---------------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        assert self._client is not None
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self.stopping:
            credential = self.credential
            try:
                response = await self._client.request(
                    "GET",
                    f"/agent/v1/nodes/{self.node_id}/commands",
                    credential=credential,
                    params={"wait": self.commands_wait_s},
                    timeout_s=self.commands_wait_s + self.config.request_timeout_s,
                )
            except PortalUnreachable as exc:
                self.log.debug("command poll: portal unreachable (%s)", exc)
                await self._sleep(backoff.next())
                continue
            outcome = classify(response.status_code)
            if outcome == OK:
                backoff.reset()
                for command in response.json().get("commands", []):
                    self.receive_command(command)
            elif outcome == REAUTH:
                await self._reauthenticate(credential)
            else:
                self.log.warning("command poll: %s", error_text(response))
                await self._sleep(backoff.next())
