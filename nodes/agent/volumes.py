"""Tenant volumes on a node: directories on the region's shared filesystem.

Every node of a region mounts the same shared filesystem (NFS, CephFS, ...) at its agent's
``volumes_root``; a volume is the directory ``<volumes_root>/vol-<id>``, named by the agent from
the volume's id and never from a path in the payload, so a forged payload cannot reach any other
host path. The root is the agent's (0711: workloads reach their own volume through it, list
nothing); it should be mounted ``nosuid,nodev`` (the agent warns when it is not).

Before a start the agent makes the directory (and, for a checkpointing job, its checkpoint
directory ``.gpupool-checkpoints/<workload id>`` in the first volume) without following any link a
workload may have left inside the volume, measures what the volume holds and refuses the start
when that is over its size. Use is the sum of the apparent sizes of its files (links not
followed); a running workload is not stopped when it writes past its size, but its next start is
refused. Measurements go to the portal in the heartbeats (``volumes``), at most one per volume per
``MEASURE_INTERVAL_S`` while a workload of this node uses it, one at each start and one when the
workload ends. Which workloads use which volumes is kept in memory: after an agent restart a
running workload's volume is measured again from its next start on this node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import RuntimeFailure, safe_name
from nodes.agent.types import WorkloadSpec, rfc3339
from nodes.agent.workload_rules import check_volume_id

log = logging.getLogger(__name__)

GIB = 1024**3
CHECKPOINTS_DIR = ".gpupool-checkpoints"
MEASURE_INTERVAL_S = 30.0


def volume_path(root: Path, volume_id: str) -> Path:
    """The directory of a volume: only ever ``<root>/vol-<digits>``."""
    return root / f"vol-{check_volume_id(volume_id)}"


def measure(path: Path) -> int:
    """Bytes a directory tree holds: the apparent sizes of its regular files, links not followed."""
    total = 0
    stack = [str(path)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue  # removed meanwhile
        except OSError:
            continue
    return total


def _open_dir(name: str, *, dir_fd: int | None = None, make: bool = False, mode: int = 0o700) -> int:
    """Open (after making, with ``make``) a directory without following a link at its last
    component: a workload that replaced it with a link gets a refusal, not the agent's help."""
    if make:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=dir_fd)
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise RuntimeFailure(f"{name} is not a directory the agent can use ({exc.strerror})") from exc


@dataclass
class Attached:
    """A volume made ready for one start."""

    volume_id: str
    host_path: Path
    mount_path: str
    size_gib: int


@dataclass
class Prepared:
    volumes: list[Attached]
    checkpoint_host: Path | None = None  # the checkpoint directory on this host
    checkpoint_in_workload: str = ""  # the same directory as the workload sees it (docker)
    resume: bool = False


class Volumes:
    """The node's volumes root, what it measured and which workloads use which volumes."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) if root else None
        self.using: dict[str, list[str]] = {}  # workload id -> volume ids
        self.measured: dict[str, tuple[int, float]] = {}  # volume id -> (bytes, when)
        self.unreported: set[str] = set()
        self._warned = False

    def _root(self) -> Path:
        if self.root is None:
            raise RuntimeFailure("this node has no volumes_root: it cannot attach volumes")
        if not self.root.is_dir():
            raise RuntimeFailure(
                f"the volumes root {self.root} is not there (is the shared filesystem mounted?)"
            )
        if not self._warned:
            self._warned = True
            with contextlib.suppress(OSError):
                flags = os.statvfs(self.root).f_flag
                if not flags & os.ST_NOSUID or not flags & os.ST_NODEV:
                    log.warning("the volumes root %s is not mounted nosuid,nodev", self.root)
            with contextlib.suppress(OSError):
                if self.root.stat().st_uid == os.geteuid():
                    os.chmod(self.root, 0o711)
        return self.root

    def prepare(self, spec: WorkloadSpec, *, owner: tuple[int, int] | None = None) -> Prepared:
        """Make each volume's directory (owned by ``owner`` when given: the process runtime's
        user), measure it and refuse one over its size; make the checkpoint directory."""
        if not spec.volumes:
            return Prepared(volumes=[])
        root = self._root()
        attached: list[Attached] = []
        prepared = Prepared(volumes=attached)
        root_fd = _open_dir(str(root))
        try:
            for v in spec.volumes:
                path = volume_path(root, v["volume_id"])
                fd = _open_dir(path.name, dir_fd=root_fd, make=True)
                try:
                    if owner is not None:
                        os.fchown(fd, *owner)
                    used = measure(path)
                    self.note(v["volume_id"], used)
                    if used > v["size_gib"] * GIB:
                        raise RuntimeFailure(
                            f"volume {v['volume_id']} holds {used / GIB:.2f} GiB, over its size of "
                            f"{v['size_gib']} GiB: free space on it or make it larger"
                        )
                    checkpoint = spec.checkpoint
                    if checkpoint is not None and checkpoint["volume_id"] == v["volume_id"]:
                        self._checkpoint_dir(fd, spec.workload_id, owner)
                        name = safe_name(spec.workload_id)
                        prepared.checkpoint_host = path / CHECKPOINTS_DIR / name
                        prepared.checkpoint_in_workload = f"{v['mount_path']}/{CHECKPOINTS_DIR}/{name}"
                        prepared.resume = bool(checkpoint.get("resume"))
                finally:
                    os.close(fd)
                attached.append(Attached(v["volume_id"], path, v["mount_path"], v["size_gib"]))
        finally:
            os.close(root_fd)
        self.using[spec.workload_id] = [a.volume_id for a in attached]
        return prepared

    @staticmethod
    def _checkpoint_dir(volume_fd: int, workload_id: str, owner: tuple[int, int] | None) -> None:
        parent = _open_dir(CHECKPOINTS_DIR, dir_fd=volume_fd, make=True, mode=0o755)
        try:
            if owner is not None:
                os.fchown(parent, *owner)
            fd = _open_dir(safe_name(workload_id), dir_fd=parent, make=True)
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise RuntimeFailure("the checkpoint directory is not a directory")
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    def note(self, volume_id: str, used: int) -> None:
        self.measured[volume_id] = (used, time.time())
        self.unreported.add(volume_id)

    @property
    def idle(self) -> bool:
        """Nothing to measure or report: no workload uses a volume and no measurement waits."""
        return not self.using and not self.unreported

    def report(self, active: set[str]) -> list[dict[str, Any]]:
        """The measurements for the next heartbeat: volumes measured since the last one, and those
        of ``active`` workloads not measured for ``MEASURE_INTERVAL_S`` (measured now)."""
        now = time.time()
        for workload_id in list(self.using):
            if workload_id not in active:
                # Its last measurement, once it ended: what it wrote is counted.
                for volume_id in self.using.pop(workload_id):
                    self._measure(volume_id)
                continue
            for volume_id in self.using[workload_id]:
                last = self.measured.get(volume_id)
                if last is None or now - last[1] >= MEASURE_INTERVAL_S:
                    self._measure(volume_id)
        out = []
        for volume_id in sorted(self.unreported):
            used, at = self.measured[volume_id]
            out.append({"volume_id": volume_id, "used_bytes": used, "measured_at": rfc3339(at)})
        self.unreported.clear()
        return out

    def _measure(self, volume_id: str) -> None:
        if self.root is None:
            return
        path = volume_path(self.root, volume_id)
        if path.is_dir() and not path.is_symlink():
            self.note(volume_id, measure(path))

    def delete(self, volume_id: str) -> dict[str, Any]:
        """Remove a volume's directory and everything in it (links removed, never followed)."""
        root = self._root()
        path = volume_path(root, volume_id)
        if not os.path.lexists(path):
            return {"volume_id": volume_id, "deleted": False, "message": "not on this filesystem"}
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)  # rmtree uses the fd-based walk: links inside are removed, not followed
        self.measured.pop(volume_id, None)
        return {"volume_id": volume_id, "deleted": True}
