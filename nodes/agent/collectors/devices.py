"""Device files of AMD and Intel GPUs: the DRM render node of a GPU, found from its PCI bus id.

A render node's number is the kernel's (``renderD128`` upwards, in probe order), not the collector's
GPU index, so it is looked up, never guessed: udev's ``/dev/dri/by-path/pci-<bus id>-render`` link,
else the PCI device's ``drm/renderD*`` entry in sysfs. The runtimes check every path again where
they use it (:func:`check_device_file`).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

RENDER_NODE_RE = re.compile(r"renderD[0-9]{1,4}", re.ASCII)
BUS_ID_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", re.ASCII)


def render_node(bus_id: str, *, dev_root: str | Path = "/dev", sysfs_root: str | Path = "/sys") -> str:
    """The render node of the GPU at PCI ``bus_id`` (``0000:0c:00.0``), or "" when none is found."""
    bus_id = bus_id.strip().lower()
    if not BUS_ID_RE.fullmatch(bus_id):
        return ""
    dri = Path(dev_root) / "dri"
    link = dri / "by-path" / f"pci-{bus_id}-render"
    if link.is_symlink() or link.exists():
        target = Path(os.path.realpath(link))
        if target.parent == Path(os.path.realpath(dri)) and RENDER_NODE_RE.fullmatch(target.name):
            return str(dri / target.name)
    drm = Path(sysfs_root) / "bus" / "pci" / "devices" / bus_id / "drm"
    try:
        names = sorted(entry.name for entry in drm.iterdir() if RENDER_NODE_RE.fullmatch(entry.name))
    except OSError:
        return ""
    return str(dri / names[0]) if names else ""


class DeviceFileError(ValueError):
    """A device path that may not be given to a workload; the message says why."""


def check_device_file(path: str, *, render: bool) -> os.stat_result:
    """``path`` is an absolute, normalised path of a character device (a render node's name is
    ``renderD<N>``); answers its stat. Raises :class:`DeviceFileError` otherwise."""
    if not path or not os.path.isabs(path) or os.path.normpath(path) != path or ":" in path:
        raise DeviceFileError(f"{path!r} is not an absolute, normalised device path")
    if render and not RENDER_NODE_RE.fullmatch(os.path.basename(path)):
        raise DeviceFileError(f"{path!r} is not a DRM render node (renderD<N>)")
    try:
        info = os.stat(path)
    except OSError as exc:
        raise DeviceFileError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISCHR(info.st_mode):
        raise DeviceFileError(f"{path} is not a character device")
    return info
