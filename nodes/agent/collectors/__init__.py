"""GPU collectors: discover the GPUs of this machine and sample their telemetry.

Every collector has the same interface (:class:`Collector`); ``make_collector`` picks one by name.
A collector that cannot work here raises :class:`CollectorUnavailable` with the reason; nothing
falls back silently to another collector (``auto`` tries NVML, AMD SMI, then ``xpu-smi`` for Intel
GPUs, and says which it chose).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nodes.agent.types import GpuSample, NodeInventory

log = logging.getLogger(__name__)

COLLECTOR_KINDS = ("nvml", "amdsmi", "xpusmi", "simulated", "auto")


class CollectorUnavailable(RuntimeError):
    """This collector cannot run on this machine; the message says why."""


class CollectorError(RuntimeError):
    """A collector operation failed (for example a MIG reconfiguration the driver refused)."""


@runtime_checkable
class Collector(Protocol):
    name: str
    # Optional ``sample_blocks`` (default True): False for a collector whose ``sample`` never waits
    # on a driver or a device, which the agent then calls on its event loop instead of a thread.

    def discover(self) -> NodeInventory:
        """The GPUs of this machine and the driver versions."""

    def sample(self, now: float) -> list[GpuSample]:
        """One sample per GPU found by ``discover``."""

    def configure_mig(self, gpu_uuid: str, enable: bool, placements: list[tuple[str, int]]) -> dict[str, Any]:
        """Staff's MIG change of an idle GPU: its instances go, MIG mode is set, and with ``enable``
        the layout's instances ((profile, start), checked against ``nodes.mig_profiles``) are made.
        Returns ``{"gpu_uuid", "mig_mode", "created": [{"profile", "start", "mig_uuid"}]}``."""

    def create_mig_instance(self, gpu_uuid: str, profile: str, start: int | None = None) -> dict[str, Any]:
        """The MIG instance of ``profile`` at memory slice ``start`` on a GPU in MIG mode: the staff
        layout's instance there, or one made there now (a GPU instance with one compute instance);
        never changes MIG mode. Returns ``{"gpu_uuid", "mig_uuid", "profile", "start", "made"}``."""

    def destroy_mig_instance(self, gpu_uuid: str, mig_uuid: str) -> dict[str, Any]:
        """Remove one MIG instance (nothing if it is gone already); MIG mode stays as it is.
        Returns ``{"gpu_uuid", "mig_uuid", "destroyed"}``."""

    def close(self) -> None:
        """Release the library."""


def make_collector(kind: str, **options: Any) -> Collector:
    """Build the collector named ``kind``. ``options`` go to the simulated collector only."""
    if kind == "nvml":
        from nodes.agent.collectors.nvml import NvmlCollector

        return NvmlCollector()
    if kind == "amdsmi":
        from nodes.agent.collectors.amd import AmdSmiCollector

        return AmdSmiCollector()
    if kind == "xpusmi":
        from nodes.agent.collectors.intel import XpuSmiCollector

        return XpuSmiCollector()
    if kind == "simulated":
        from nodes.agent.collectors.simulated import SimulatedCollector

        return SimulatedCollector(**options)
    if kind == "auto":
        reasons = []
        for candidate in ("nvml", "amdsmi", "xpusmi"):
            try:
                collector = make_collector(candidate)
            except CollectorUnavailable as exc:
                reasons.append(str(exc))
                continue
            log.info("collector auto: chose %s", candidate)
            return collector
        raise CollectorUnavailable("no GPU collector is available: " + "; ".join(reasons))
    raise ValueError(f"unknown collector {kind!r}; expected one of {', '.join(COLLECTOR_KINDS)}")
