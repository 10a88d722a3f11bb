"""Many simulated agents in one process: one :class:`Agent` per node of a fleet file, each with its
own state directory (``<state root>/<hostname>/``), all speaking real HTTP to the portal.

The fleet file (written by the portal's ``seed_demo``; see "Simulated fleet file" in
``nodes/PROTOCOL.md``)::

    {"portal_url": "http://127.0.0.1:8000",
     "nodes": [{"hostname": "sim-use1-001", "region": "us-east-1", "bootstrap_token": "gpb_...",
                "cpu_cores": 96, "ram_mib": 1048576, "interconnect": "nvswitch",
                "labels": {"rack": "r1"}, "gpus": [{"model": "NVIDIA H100 80GB HBM3", "count": 8}]}]}

Unknown fields are ignored. The launcher waits for the file to appear, and each agent retries its
registration until the portal answers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import sys
import zlib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nodes.agent.agent import Agent, FatalAgentError
from nodes.agent.config import AgentConfig, ConfigError

log = logging.getLogger(__name__)


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine by a loopback name or address."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_config(
    node: dict[str, Any],
    *,
    portal_url: str,
    state_root: Path,
    heartbeat_interval_s: float | None = None,
    backoff_max_s: float = 5.0,
    allow_insecure_http: bool = False,
) -> AgentConfig:
    """One node's settings. Plain http:// is accepted for a portal on loopback (the simulated fleet
    beside a local portal), anywhere else only when ``allow_insecure_http`` says so."""
    hostname = str(node.get("hostname") or "")
    if not hostname:
        raise ConfigError("a fleet node has no hostname")
    return AgentConfig(
        portal_url=portal_url,
        allow_insecure_http=allow_insecure_http or is_loopback(portal_url),
        bootstrap_token=str(node.get("bootstrap_token") or ""),
        state_dir=str(state_root / hostname),
        collector="simulated",
        runtime="simulated",
        region=str(node.get("region") or ""),
        labels={str(k): str(v) for k, v in (node.get("labels") or {}).items()},
        hostname=hostname,
        heartbeat_interval_s=heartbeat_interval_s,
        sim_gpus=[
            {"model": g["model"], "count": int(g.get("count", 1)), "memory_mib": g.get("memory_mib")}
            for g in node.get("gpus") or []
        ],
        cpu_cores=node.get("cpu_cores"),
        ram_mib=node.get("ram_mib"),
        interconnect=str(node.get("interconnect") or "nvswitch"),
        seed=zlib.crc32(hostname.encode()),
        heartbeat_phase=random.Random(zlib.crc32(hostname.encode())).random(),
        backoff_max_s=backoff_max_s,
        # A rolling upgrade staff can run on the demo fleet: a second's pause, nothing changed.
        upgrades={"simulated": [sys.executable, "-c", "import time; time.sleep(1)"]},
    ).validate()


class Fleet:
    def __init__(
        self,
        fleet_file: str | Path,
        *,
        portal_url: str | None = None,
        state_root: str | Path = "var/agents",
        heartbeat_interval_s: float | None = None,
        file_poll_s: float = 1.0,
        allow_insecure_http: bool = False,
    ) -> None:
        self.fleet_file = Path(fleet_file)
        self.portal_url = portal_url
        self.allow_insecure_http = allow_insecure_http
        self.state_root = Path(state_root)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.file_poll_s = file_poll_s
        self.agents: list[Agent] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False

    def request_stop(self) -> None:
        self._stop_requested = True
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        for agent in self.agents:
            agent.request_stop()

    async def _read_fleet_file(self) -> dict[str, Any] | None:
        announced = False
        assert self._stop is not None
        while not self._stop.is_set():
            try:
                data = json.loads(self.fleet_file.read_text())
                if isinstance(data, dict) and isinstance(data.get("nodes"), list):
                    return data
                log.warning("fleet file %s has no nodes list; waiting", self.fleet_file)
            except FileNotFoundError:
                if not announced:
                    log.info("waiting for the fleet file %s", self.fleet_file)
                    announced = True
            except ValueError:
                pass  # being written right now
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.file_poll_s)
            except TimeoutError:
                continue
        return None

    async def run(self) -> int:
        """Run every node's agent until stopped; the number of agents that ended in error."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        data = await self._read_fleet_file()
        if data is None:
            return 0
        portal_url = self.portal_url or str(data.get("portal_url") or "")
        # The portal URL and its transport are every node's: a refusal stops the fleet (ConfigError).
        AgentConfig(
            portal_url=portal_url,
            allow_insecure_http=self.allow_insecure_http or is_loopback(portal_url),
            collector="simulated",
            runtime="simulated",
            hostname="fleet",
        ).validate()
        for node in data["nodes"]:
            try:
                config = node_config(
                    node,
                    portal_url=portal_url,
                    state_root=self.state_root,
                    heartbeat_interval_s=self.heartbeat_interval_s,
                    allow_insecure_http=self.allow_insecure_http,
                )
                self.agents.append(Agent(config))
            except (ConfigError, KeyError, TypeError, ValueError) as exc:
                log.error("fleet node %s left out: %s", node.get("hostname", "?"), exc)
        log.info("simulated fleet: %d agent(s) for %s", len(self.agents), portal_url)
        if self._stop.is_set():
            for agent in self.agents:
                agent.request_stop()
        results = await asyncio.gather(*(self._run_one(agent, i) for i, agent in enumerate(self.agents)))
        return sum(1 for ok in results if not ok)

    async def _run_one(self, agent: Agent, position: int) -> bool:
        # Spread the first registrations a little so the portal is not hit by all of them at once.
        await asyncio.sleep(random.Random(position).uniform(0, 0.5))
        if self._stop_requested:
            agent.request_stop()
        try:
            await agent.run()
        except FatalAgentError as exc:
            log.error("[%s] agent stopped: %s", agent.config.hostname, exc)
            return False
        return True
