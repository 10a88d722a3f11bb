"""A request's minimum driver, CUDA and ROCm versions (``min_driver``, ``min_cuda``, ``min_rocm``).

Each is a release version as ``packaging.version`` reads it (``12``, ``12.4``, ``550.54.15``; no
pre-release, post, dev or local part), stored normalised. The scheduler places the request only on a
node whose reported version is at least that (``scheduling.engine``: a node that reports none
qualifies for no minimum); the node's versions are what its last heartbeat carried. ``min_cuda``
narrows the request to NVIDIA models and ``min_rocm`` to AMD ones; ``min_driver`` compares the
vendor's own driver numbers, so it needs the request's models to be of one vendor.
"""

from __future__ import annotations

from typing import Any

from packaging.version import InvalidVersion, Version

from portal.errors import ValidationFailed

MIN_VERSION_FIELDS = ("min_driver", "min_cuda", "min_rocm")
# The stack each minimum needs; min_driver has none of its own.
FIELD_VENDOR = {"min_cuda": "nvidia", "min_rocm": "amd"}


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def min_version_parse(value: Any, field: str) -> str:
    """One minimum, normalised ("" when absent), or a 400 naming ``field``."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise _fail(field, "Must be a version string such as 12.4.")
    if len(value) > 32:
        raise _fail(field, "At most 32 characters.")
    try:
        version = Version(value.strip())
    except InvalidVersion:
        raise _fail(field, f"Not a version: {value!r} (a release version such as 12.4).") from None
    if version.epoch or version.pre or version.post is not None or version.dev is not None or version.local:
        raise _fail(field, "A release version such as 12.4: no epoch, pre-release, post, dev or local part.")
    return str(version)


def min_versions_validate(spec: dict) -> dict[str, str]:
    """The three minimums of a spec, normalised; CUDA and ROCm together is a 400 (a GPU has one)."""
    out = {field: min_version_parse(spec.get(field), field) for field in MIN_VERSION_FIELDS}
    if out["min_cuda"] and out["min_rocm"]:
        raise _fail("min_rocm", "A GPU has CUDA or ROCm, not both: give min_cuda or min_rocm.")
    return out


def min_versions_vendor_ok(vendor: str, values: dict[str, Any]) -> bool:
    """Whether a model of ``vendor`` can meet these minimums at all (CUDA: NVIDIA; ROCm: AMD)."""
    return all(not values.get(field) or vendor == need for field, need in FIELD_VENDOR.items())


def min_driver_check(values: dict[str, Any], vendors: set[str]) -> None:
    """``min_driver`` needs one vendor among the request's models: driver numbers are the vendor's own."""
    if values.get("min_driver") and len(vendors) > 1:
        raise _fail(
            "min_driver",
            "Driver versions differ by vendor: name gpu_vendor, or GPU models of one vendor.",
        )
