"""The rules every tenant-given field of a workload obeys, checked twice: by the portal when the
workload is submitted (a 400 naming the field) and by the agent before it starts anything (a
``start_workload`` that breaks them is refused and reported ``start_failed`` with the reason).

Plain Python, no Django: the agent imports it, and so does the portal.

The rules, once:

- ``image``: an OCI image reference as the distribution/reference grammar writes it,
  ``[host[:port]/]path[:tag][@algorithm:hex]``: path components of lowercase letters and digits
  joined by ``.``, ``_``, ``__`` or dashes; a tag of at most 128 of ``[A-Za-z0-9_.-]`` not starting
  with ``.`` or ``-``; a digest such as ``sha256:`` and 64 hex digits. The name is at most 255
  characters and so is the whole reference (the portal's column). Nothing else: no leading ``-``
  (it would be read as an option of ``docker``), no whitespace, no control characters.
- ``env``: an object of at most 256 names, at most 64 KiB of names and values together (UTF-8).
  Names match ``[A-Za-z_][A-Za-z0-9_]*``; values are any text without NUL and reach the workload
  exactly as given. Names the platform sets or that steer the GPU stack or the loader are refused
  (``RESERVED_ENV_NAMES`` and ``RESERVED_ENV_PREFIXES``), except the two simulation settings of
  ``TENANT_GPUPOOL_ENV``.
- ``command``: a list of at most 1024 strings without NUL, at most 128 KiB together.
- ``ports``: a list of at most 64 container ports, each an integer 1-65535 (an HTTP port) or
  ``{"port": N, "protocol": "http"|"tcp"}``; duplicates are dropped and the list is sorted. The
  tenant never chooses a host port or address: the runtime publishes each container port on a port
  the host picks, on the address the agent's configuration names for its protocol.
- ``volumes``: at most ``MAX_VOLUMES`` of ``{"volume_id", "mount_path", "size_gib"}``. The id is
  the portal's (digits); the agent alone turns it into a directory (``<volumes_root>/vol-<id>``), so
  no payload names a host path. ``mount_path`` is where the workload sees it: absolute, normalised
  (no ``.``/``..`` components, no ``//``, no trailing ``/``), of ``[A-Za-z0-9._-]`` components, at
  most 255 characters, not ``/`` and not at or under a system path (``FORBIDDEN_MOUNT_ROOTS``:
  ``/proc``, ``/sys``, ``/dev``, ``/etc``, ``/usr``, ``/bin``, ``/lib``..., ``/run``, where the
  platform's notice directory is); one volume per path and one path per volume, and no path
  inside another's. ``checkpoint``: ``{"volume_id", "resume"}``, one of those volumes.
- What else a start payload carries that reaches a path or an argv: ``workload_id``,
  ``gpu_uuids``, ``mig_profile``, ``gpu_vendor``, ``template`` and the numbers
  (``cpu_millicores``, ``ram_mib``, ...), each with its own rule below.
- ``ssh_public_key`` (a workload's, and every saved key): one OpenSSH public key that the
  cryptography package loads, ed25519, ECDSA or RSA of at least 2048 bits
  (:func:`parse_ssh_public_key`); the agent's SSH endpoint parses each key again before it trusts it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

MAX_IMAGE_LENGTH = 255
MAX_IMAGE_NAME_LENGTH = 255  # distribution/reference's NameTotalLengthMax
MAX_ENV_COUNT = 256
MAX_ENV_BYTES = 64 * 1024
MAX_COMMAND_COUNT = 1024
MAX_COMMAND_BYTES = 128 * 1024
MAX_PORTS = 64
MAX_GPUS = 64
MAX_WORKLOAD_ID_LENGTH = 64
MAX_TEMPLATE_LENGTH = 100
MAX_SSH_KEY_LENGTH = 16_000
MAX_SSH_KEY_COMMENT = 200
MIN_RSA_BITS = 2048
SSH_KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)

MAX_VOLUMES = 8
MAX_MOUNT_PATH_LENGTH = 255
MAX_VOLUME_SIZE_GIB = 1 << 20

# A volume is never mounted at or under these: the system's own trees and the platform's /run/gpupool.
FORBIDDEN_MOUNT_ROOTS = (
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/boot",
    "/run",
    "/var/run",
    "/var/lock",
)

# Environment names the platform sets, or that choose the GPUs, the MPS limits or the code the
# loader runs; a tenant may set none of them. Exact names first, then prefixes.
RESERVED_ENV_NAMES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",  # the workload's GPUs (process runtime)
        "ROCR_VISIBLE_DEVICES",  # AMD: the ROCm runtime's device list
        "HIP_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",  # AMD OpenCL
        "AMD_VISIBLE_DEVICES",  # the AMD container toolkit's device list
        "ZE_AFFINITY_MASK",  # Intel Level Zero
        "ZE_ENABLE_PCI_ID_DEVICE_ORDER",  # the order ZE_AFFINITY_MASK's indices refer to
        "ONEAPI_DEVICE_SELECTOR",
    }
)
RESERVED_ENV_PREFIXES = (
    "GPUPOOL_",  # the platform's own: workload id, preemption notice, GPU share, the agent's settings
    "NVIDIA_",  # read by the NVIDIA container toolkit (NVIDIA_VISIBLE_DEVICES=all: every GPU)
    "CUDA_MPS_",  # the MPS share's memory and SM limits and the daemon's pipes
    "LD_",  # the dynamic loader (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT)
    "DOCKER_",  # the docker client's settings
)
# GPUPOOL_ names a tenant may set: the simulated runtime reads them from the workload's own env
# (how long it runs, its exit code); no real runtime reads them.
TENANT_GPUPOOL_ENV = frozenset({"GPUPOOL_SIM_DURATION_S", "GPUPOOL_SIM_EXIT_CODE"})

# Names the portal may set in a start payload's ``platform_env`` (never the tenant's ``env``): a job
# array task's index and the array's size, a work-queue worker's endpoint and token, and a gang
# member's rank and rendezvous (torchrun's and NCCL's names, and the members' addresses by rank).
PLATFORM_ENV_NAMES = frozenset(
    {
        "GPUPOOL_ARRAY_INDEX",
        "GPUPOOL_ARRAY_COUNT",
        "GPUPOOL_WORK_URL",
        "GPUPOOL_WORK_TOKEN",
        "WORLD_SIZE",
        "NODE_RANK",
        "NNODES",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GPUPOOL_PEERS",
    }
)

GPU_VENDORS = ("", "nvidia", "amd", "intel")
# "http": reached through the portal's proxy only; "tcp": a raw port on the node (docs/security.md).
PORT_PROTOCOLS = ("http", "tcp")

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)

# distribution/reference (reference/regexp.go), written out.
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_NAME_RE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*", re.ASCII)
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_DIGEST_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}", re.ASCII)
_DIGEST_HEX_LENGTHS = {"sha256": 64, "sha384": 96, "sha512": 128}  # the algorithms registries use

_WORKLOAD_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)
# GPU and MIG UUIDs (GPU-..., MIG-...) and AMD's hex UUIDs; never a comma, quote or space, which
# would change docker's --gpus device list.
_GPU_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}", re.ASCII)
_MIG_PROFILE_RE = re.compile(r"[1-7]g\.[0-9]{1,4}gb", re.ASCII)
_TEMPLATE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*", re.ASCII)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_MOUNT_COMPONENT_RE = re.compile(r"[A-Za-z0-9._-]+", re.ASCII)
_VOLUME_ID_RE = re.compile(r"[1-9][0-9]{0,18}", re.ASCII)


class WorkloadRuleError(ValueError):
    """A field breaks its rule; ``field`` names it, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_image(value: Any) -> str:
    """An OCI image reference (see the module's docstring), returned as given."""
    if not isinstance(value, str):
        raise WorkloadRuleError("image", "Must be a string.")
    if not value:
        raise WorkloadRuleError("image", "Must not be empty.")
    if len(value) > MAX_IMAGE_LENGTH:
        raise WorkloadRuleError("image", f"At most {MAX_IMAGE_LENGTH} characters.")
    if value.startswith("-"):
        raise WorkloadRuleError("image", "Must not start with '-' (an image reference is not an option).")
    if any(ch.isspace() for ch in value) or _CONTROL_RE.search(value):
        raise WorkloadRuleError("image", "Must not contain whitespace or control characters.")
    rest, _, digest = value.partition("@")
    # A tag follows the last ':' that comes after the last '/' (an earlier one is the registry's port).
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    name, tag = (rest[:colon], rest[colon + 1 :]) if colon > slash else (rest, None)
    if not name or not _NAME_RE.fullmatch(name):
        raise WorkloadRuleError(
            "image",
            f"{name!r} is not an image name: [registry[:port]/]path, the path in lowercase letters, "
            "digits and the separators . _ __ -.",
        )
    if len(name) > MAX_IMAGE_NAME_LENGTH:
        raise WorkloadRuleError("image", f"The name is at most {MAX_IMAGE_NAME_LENGTH} characters.")
    if tag is not None and not _TAG_RE.fullmatch(tag):
        raise WorkloadRuleError(
            "image", f"{tag!r} is not a tag: up to 128 of A-Z a-z 0-9 _ . -, not starting with . or -."
        )
    if "@" in value:
        if not _DIGEST_RE.fullmatch(digest):
            raise WorkloadRuleError("image", f"{digest!r} is not a digest (like sha256:<64 hex digits>).")
        algorithm, _, hex_digits = digest.partition(":")
        expected = _DIGEST_HEX_LENGTHS.get(algorithm)
        if expected is not None and len(hex_digits) != expected:
            raise WorkloadRuleError("image", f"A {algorithm} digest has {expected} hex digits.")
    return value


def _reserved(name: str) -> bool:
    if name in TENANT_GPUPOOL_ENV:
        return False
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def check_env(mapping: Any) -> dict[str, str]:
    """The workload's environment (see the module's docstring), as a new dict."""
    if not isinstance(mapping, Mapping):
        raise WorkloadRuleError("env", "Must be an object of strings.")
    if len(mapping) > MAX_ENV_COUNT:
        raise WorkloadRuleError("env", f"At most {MAX_ENV_COUNT} variables.")
    env: dict[str, str] = {}
    size = 0
    for key, value in mapping.items():
        if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
            raise WorkloadRuleError(
                "env", f"{key!r} is not a variable name: letters, digits and _, not starting with a digit."
            )
        if not isinstance(value, str):
            raise WorkloadRuleError("env", f"{key}: the value must be a string.")
        if "\x00" in value:
            raise WorkloadRuleError("env", f"{key}: the value must not contain NUL.")
        if _reserved(key):
            raise WorkloadRuleError("env", f"{key} is set by the platform; a workload cannot set it.")
        size += len(key.encode()) + len(value.encode("utf-8", "surrogatepass"))
        env[key] = value
    if size > MAX_ENV_BYTES:
        raise WorkloadRuleError("env", f"At most {MAX_ENV_BYTES // 1024} KiB of names and values together.")
    return env


def check_command(value: Any) -> list[str]:
    """The workload's argv (see the module's docstring), as a new list."""
    if not isinstance(value, list | tuple) or not all(isinstance(part, str) for part in value):
        raise WorkloadRuleError("command", "Must be a list of strings.")
    if len(value) > MAX_COMMAND_COUNT:
        raise WorkloadRuleError("command", f"At most {MAX_COMMAND_COUNT} arguments.")
    if any("\x00" in part for part in value):
        raise WorkloadRuleError("command", "An argument must not contain NUL.")
    if sum(len(part.encode("utf-8", "surrogatepass")) for part in value) > MAX_COMMAND_BYTES:
        raise WorkloadRuleError("command", f"At most {MAX_COMMAND_BYTES // 1024} KiB together.")
    return list(value)


def check_ports(value: Any) -> list[dict[str, Any]]:
    """Container ports to publish, as ``[{"port": 8888, "protocol": "http"}, ...]`` sorted by port.

    Each item is a port number (an HTTP port) or an object ``{"port": N, "protocol": "http"|"tcp"}``
    (protocol ``http`` when left out). A port named twice with the same protocol counts once; with
    two protocols it is refused. Each is published on a host port the host picks (``docker run -p
    <port>``); there is no way to name a host port."""
    if not isinstance(value, list | tuple):
        raise WorkloadRuleError("ports", "Must be a list of ports: numbers (1-65535) or {port, protocol}.")
    if len(value) > MAX_PORTS:
        raise WorkloadRuleError("ports", f"At most {MAX_PORTS} ports.")
    protocols: dict[int, str] = {}
    for item in value:
        if isinstance(item, Mapping):
            unknown = set(item) - {"port", "protocol"}
            if unknown:
                raise WorkloadRuleError(
                    "ports", f"Unknown key {sorted(map(str, unknown))[0]!r}: port, protocol."
                )
            port, protocol = item.get("port"), item.get("protocol", "http")
        else:
            port, protocol = item, "http"
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise WorkloadRuleError("ports", f"{port!r} is not a port number (1-65535).")
        if protocol not in PORT_PROTOCOLS:
            raise WorkloadRuleError("ports", f"{port}: protocol must be one of {', '.join(PORT_PROTOCOLS)}.")
        if protocols.setdefault(port, protocol) != protocol:
            raise WorkloadRuleError("ports", f"{port} is named twice with different protocols.")
    return [{"port": port, "protocol": protocols[port]} for port in sorted(protocols)]


def check_workload_id(value: Any) -> str:
    """The workload's id (the portal sends its primary key as a string): it names files and
    containers, so letters, digits and ``_.-`` only, at most 64."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _WORKLOAD_ID_RE.fullmatch(value):
        raise WorkloadRuleError(
            "workload_id", "Letters, digits and _ . - only, starting with a letter or digit."
        )
    if len(value) > MAX_WORKLOAD_ID_LENGTH:
        raise WorkloadRuleError("workload_id", f"At most {MAX_WORKLOAD_ID_LENGTH} characters.")
    return value


def check_gpu_uuids(value: Any) -> list[str]:
    """The GPUs (or MIG devices) to give the workload: at most 64 distinct UUIDs."""
    if not isinstance(value, list | tuple):
        raise WorkloadRuleError("gpu_uuids", "Must be a list of GPU UUIDs.")
    if len(value) > MAX_GPUS:
        raise WorkloadRuleError("gpu_uuids", f"At most {MAX_GPUS} GPUs.")
    for uuid in value:
        if not isinstance(uuid, str) or not _GPU_UUID_RE.fullmatch(uuid):
            raise WorkloadRuleError("gpu_uuids", f"{uuid!r} is not a GPU UUID.")
    if len(set(value)) != len(value):
        raise WorkloadRuleError("gpu_uuids", "A GPU is named twice.")
    return list(value)


def check_mig_profile(value: Any) -> str:
    """A MIG profile such as ``1g.10gb``, or empty."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or not _MIG_PROFILE_RE.fullmatch(value):
        raise WorkloadRuleError("mig_profile", "A MIG profile like 1g.10gb.")
    return value


def check_gpu_vendor(value: Any) -> str:
    if value is None:
        return ""
    if value not in GPU_VENDORS:
        raise WorkloadRuleError("gpu_vendor", f"One of {', '.join(v for v in GPU_VENDORS if v)}, or empty.")
    return value


def check_template(value: Any) -> str:
    """An instance template's name, or empty."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or len(value) > MAX_TEMPLATE_LENGTH or not _TEMPLATE_RE.fullmatch(value):
        raise WorkloadRuleError(
            "template", f"A template name: letters, digits and _ . : / -, at most {MAX_TEMPLATE_LENGTH}."
        )
    return value


@dataclass(frozen=True)
class SshPublicKey:
    """A checked OpenSSH public key: ``line`` is ``type base64[ comment]`` as the key itself
    encodes it (the tenant's spacing and options never survive), ``fingerprint`` what
    ``ssh-keygen -l`` prints (``SHA256:...``)."""

    line: str
    fingerprint: str
    kind: str
    bits: int


def parse_ssh_public_key(value: Any, field: str = "ssh_public_key") -> SshPublicKey:
    """One OpenSSH public key (``type base64 [comment]``) that the cryptography package loads:
    ed25519, ECDSA (P-256, P-384, P-521) or RSA of at least 2048 bits. DSA, security-key (``sk-``)
    and certificate types, ``authorized_keys`` options and anything that is not one line are
    refused with :class:`WorkloadRuleError` naming ``field``."""
    if not isinstance(value, str):
        raise WorkloadRuleError(field, "One line of text.")
    value = value.strip()  # a pasted file's final newline; one inside would add a second key
    if _CONTROL_RE.search(value):
        raise WorkloadRuleError(field, "One line without control characters.")
    if len(value) > MAX_SSH_KEY_LENGTH:
        raise WorkloadRuleError(field, f"At most {MAX_SSH_KEY_LENGTH} characters.")
    parts = value.split(None, 2)
    if len(parts) < 2:
        raise WorkloadRuleError(field, "An OpenSSH public key: 'type base64 [comment]'.")
    kind, blob = parts[0], parts[1]
    comment = parts[2].strip() if len(parts) > 2 else ""
    if kind not in SSH_KEY_TYPES:
        raise WorkloadRuleError(field, f"The key type must be one of {', '.join(SSH_KEY_TYPES)}.")
    try:
        raw = base64.b64decode(blob, validate=True)
        key = serialization.load_ssh_public_key(f"{kind} {blob}".encode())
    except (ValueError, UnsupportedAlgorithm, binascii.Error):
        raise WorkloadRuleError(field, "Not a valid OpenSSH public key.") from None
    if isinstance(key, rsa.RSAPublicKey):
        bits = key.key_size
        if bits < MIN_RSA_BITS:
            raise WorkloadRuleError(
                field, f"An RSA key needs at least {MIN_RSA_BITS} bits; this one has {bits}."
            )
    elif isinstance(key, ec.EllipticCurvePublicKey):
        bits = key.curve.key_size
    elif isinstance(key, ed25519.Ed25519PublicKey):
        bits = 256
    else:  # pragma: no cover - the type list above admits nothing else
        raise WorkloadRuleError(field, "Not an ed25519, ECDSA or RSA key.")
    canonical = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    if canonical.split()[1] != blob or base64.b64encode(raw).decode() != blob:
        raise WorkloadRuleError(field, "Not a valid OpenSSH public key.")
    digest = base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
    line = f"{canonical} {comment[:MAX_SSH_KEY_COMMENT]}".strip()
    return SshPublicKey(line=line, fingerprint=f"SHA256:{digest}", kind=kind, bits=bits)


def check_ssh_public_key(value: Any) -> str:
    """The per-workload key: empty, or one key as :func:`parse_ssh_public_key` takes it (its
    normalised line)."""
    if value in (None, ""):
        return ""
    return parse_ssh_public_key(value).line


def check_mount_path(value: Any, field: str = "mount_path") -> str:
    """Where a volume appears in the workload (see the module's docstring), returned as given."""
    if not isinstance(value, str) or not value:
        raise WorkloadRuleError(field, "An absolute path such as /workspace.")
    if len(value) > MAX_MOUNT_PATH_LENGTH:
        raise WorkloadRuleError(field, f"At most {MAX_MOUNT_PATH_LENGTH} characters.")
    if not value.startswith("/"):
        raise WorkloadRuleError(field, "Must be an absolute path (start with /).")
    if value == "/":
        raise WorkloadRuleError(field, "Must not be / itself.")
    parts = value[1:].split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise WorkloadRuleError(field, "Must be normalised: no empty, . or .. components, no trailing /.")
        if not _MOUNT_COMPONENT_RE.fullmatch(part):
            raise WorkloadRuleError(field, "Path components are letters, digits and . _ - only.")
    for root in FORBIDDEN_MOUNT_ROOTS:
        if value == root or value.startswith(root + "/"):
            raise WorkloadRuleError(field, f"Must not be at or under {root} (a system path).")
    return value


def check_volume_id(value: Any, field: str = "volume_id") -> str:
    """A volume's id as the portal sends it (its primary key, digits); it names a directory."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _VOLUME_ID_RE.fullmatch(value):
        raise WorkloadRuleError(field, "A volume id (a positive integer).")
    return value


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_volumes(value: Any) -> list[dict[str, Any]]:
    """A start payload's ``volumes``: each ``{"volume_id", "mount_path", "size_gib"}`` checked, no
    volume or path twice, no path inside another's."""
    if value in (None, ""):
        return []
    if not isinstance(value, list | tuple):
        raise WorkloadRuleError("volumes", "Must be a list of volumes.")
    if len(value) > MAX_VOLUMES:
        raise WorkloadRuleError("volumes", f"At most {MAX_VOLUMES} volumes.")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise WorkloadRuleError("volumes", f"volumes[{i}]: must be an object.")
        volume_id = check_volume_id(item.get("volume_id"), "volumes")
        path = check_mount_path(item.get("mount_path"), "volumes")
        size = item.get("size_gib")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_VOLUME_SIZE_GIB:
            raise WorkloadRuleError("volumes", f"volumes[{i}].size_gib: an integer 1-{MAX_VOLUME_SIZE_GIB}.")
        for other in out:
            if other["volume_id"] == volume_id:
                raise WorkloadRuleError("volumes", f"Volume {volume_id} is attached twice.")
            if _nested(other["mount_path"], path):
                raise WorkloadRuleError("volumes", f"{path} and {other['mount_path']}: one volume per path.")
        out.append({"volume_id": volume_id, "mount_path": path, "size_gib": size})
    return out


def check_checkpoint(value: Any, volumes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A start payload's ``checkpoint``: ``{"volume_id", "resume"}`` naming one of its volumes."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise WorkloadRuleError("checkpoint", "Must be an object.")
    volume_id = check_volume_id(value.get("volume_id"), "checkpoint")
    if volume_id not in {v["volume_id"] for v in volumes}:
        raise WorkloadRuleError("checkpoint", "Checkpoints go on one of the workload's volumes.")
    resume = value.get("resume", False)
    if not isinstance(resume, bool):
        raise WorkloadRuleError("checkpoint", "resume: true or false.")
    return {"volume_id": volume_id, "resume": resume}


def check_platform_env(mapping: Any) -> dict[str, str]:
    """The platform's own variables of a start payload: known names only, short printable values."""
    if not isinstance(mapping, Mapping):
        raise WorkloadRuleError("platform_env", "Must be an object of strings.")
    out: dict[str, str] = {}
    for key, value in mapping.items():
        if key not in PLATFORM_ENV_NAMES:
            raise WorkloadRuleError("platform_env", f"{key!r} is not a platform variable.")
        if not isinstance(value, str) or len(value) > 2048 or not value.isprintable():
            raise WorkloadRuleError("platform_env", f"{key}: a printable string of at most 2048 characters.")
        out[key] = value
    return out


def check_gang_network(value: Any) -> dict[str, str]:
    """A gang member's place on its region's gang network (``{"subnet", "range", "gateway"?,
    "address"}``): IPv4 networks in CIDR form, the range within the subnet, the gateway and the
    member's address within it (the address within the range). Staff set the region's network;
    checked here again, as every payload field is, before it reaches the engine."""
    if not isinstance(value, Mapping):
        raise WorkloadRuleError("gang_network", "Must be an object.")
    unknown = set(value) - {"subnet", "range", "gateway", "address"}
    if unknown:
        raise WorkloadRuleError("gang_network", f"Unknown field {sorted(unknown)[0]!r}.")
    nets = {}
    for key in ("subnet", "range"):
        raw = value.get(key)
        try:
            if not isinstance(raw, str):
                raise ValueError
            net = ipaddress.ip_network(raw, strict=True)
            if net.version != 4 or net.is_loopback or net.is_link_local or net.is_multicast:
                raise ValueError
        except ValueError:
            raise WorkloadRuleError("gang_network", f"{key}: an IPv4 network in CIDR form.") from None
        nets[key] = net
    if not nets["range"].subnet_of(nets["subnet"]):  # type: ignore[arg-type]
        raise WorkloadRuleError("gang_network", "range: must lie within the subnet.")
    out = {"subnet": str(nets["subnet"]), "range": str(nets["range"])}
    for key, within in (("address", nets["range"]), ("gateway", nets["subnet"])):
        raw = value.get(key)
        if raw is None and key == "gateway":
            continue
        try:
            if not isinstance(raw, str):
                raise ValueError
            address = ipaddress.IPv4Address(raw)
        except ValueError:
            raise WorkloadRuleError("gang_network", f"{key}: an IPv4 address.") from None
        if address not in within:
            raise WorkloadRuleError("gang_network", f"{key}: {address} is not within {within}.")
        out[key] = str(address)
    return out


def _check_number(payload: Mapping[str, Any], key: str, lo: float, hi: float, *, real: bool = False) -> Any:
    value = payload.get(key)
    if value is None:
        return None
    kinds = (int, float) if real else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "A number" if real else "An integer"
        raise WorkloadRuleError(key, f"{kind} between {lo} and {hi}.")
    return value


# The numbers of a start payload and their bounds; they reach docker's --cpus and --memory.
_NUMBERS: dict[str, tuple[float, float, bool]] = {
    "gpu_fraction_milli": (1, 1000, False),
    "cpu_millicores": (0, 10_000_000, False),
    "ram_mib": (0, 1 << 40, False),
    "max_runtime_s": (0, 366 * 86400, False),
    "gpu_memory_limit_mib": (0, 1 << 30, False),
    "sim_duration_s": (0, 366 * 86400, True),
    "attempt": (0, 1 << 31, False),
    "mig_start": (0, 7, False),
}


def check_start_payload(payload: Any) -> dict[str, Any]:
    """A ``start_workload`` payload with every field checked; fields this module does not know pass
    through unchanged (the protocol ignores unknown fields). Raises :class:`WorkloadRuleError`."""
    if not isinstance(payload, Mapping):
        raise WorkloadRuleError("payload", "Must be an object.")
    if payload.get("workload_id") in (None, ""):
        raise WorkloadRuleError("workload_id", "Required.")
    checked = dict(payload)
    checked["workload_id"] = check_workload_id(payload["workload_id"])
    image = payload.get("image")
    checked["image"] = "" if image in (None, "") else check_image(image)
    checked["command"] = check_command(payload.get("command") or [])
    checked["env"] = check_env(payload.get("env") or {})
    checked["ports"] = check_ports(payload.get("ports") or [])
    checked["gpu_uuids"] = check_gpu_uuids(payload.get("gpu_uuids") or [])
    if "platform_env" in payload:
        raw = payload["platform_env"]
        checked["platform_env"] = check_platform_env({} if raw is None else raw)
    for key, check in (
        ("mig_profile", check_mig_profile),
        ("gpu_vendor", check_gpu_vendor),
        ("template", check_template),
        ("ssh_public_key", check_ssh_public_key),
        ("gang_network", check_gang_network),
    ):
        if key in payload:
            checked[key] = check(payload[key])
    if "volumes" in payload or "checkpoint" in payload:
        checked["volumes"] = check_volumes(payload.get("volumes"))
        checked["checkpoint"] = check_checkpoint(payload.get("checkpoint"), checked["volumes"])
    for key, (lo, hi, real) in _NUMBERS.items():
        if key in payload:
            checked[key] = _check_number(payload, key, lo, hi, real=real)
    return checked
