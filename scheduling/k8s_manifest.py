"""A Kubernetes ``batch/v1`` Job manifest as a job spec (``POST /api/v1/jobs/`` in YAML or JSON).

The rule, once: a manifest is translated into the same spec dict a JSON request sends, and then
goes through ``workload_submit`` like any other, so every check applies. What is translated:

- the first container's ``image``, ``command`` + ``args`` (the workload's command), ``env`` (plain
  values only; ``valueFrom`` and ``envFrom`` are refused);
- its ``resources.limits`` (``requests`` where a limit is absent): ``nvidia.com/gpu`` is the GPU
  count, ``nvidia.com/gpu.model`` the model, ``cpu`` and ``memory`` the CPU and RAM;
- the pod's ``nodeSelector``: ``nvidia.com/gpu.product`` the model (as GPU Feature Discovery labels
  it, e.g. ``NVIDIA-A100-SXM4-80GB``), ``topology.kubernetes.io/region`` the region, any other
  key the workload's ``node_selector`` (the labels agents register);
- ``completions``/``parallelism`` an array, ``backoffLimit`` the retries, ``activeDeadlineSeconds``
  the maximum runtime, ``metadata.name`` the name.

A model name matches every catalog model one of whose names contains it as whole words, so a family
name (``A100``) matches every A100 and a product label matches its one model. A field that changes
what runs and cannot be honoured is a 400 naming it by its path in the manifest
(``spec.template.spec.containers[0].env[0].valueFrom``); any other field that is not translated is
named in the answer's ``warnings``, never dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from nodes.models import GpuModel
from portal.errors import ValidationFailed

GPU = "nvidia.com/gpu"
GPU_MODEL = "nvidia.com/gpu.model"
GPU_PRODUCT = "nvidia.com/gpu.product"
REGION_LABEL = "topology.kubernetes.io/region"
CONTAINER = "spec.template.spec.containers[0]"
_CPU_RE = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T|k)?$")
_MEM_MIB = {
    None: Decimal(1) / (1024 * 1024),
    "k": Decimal(1000) / (1024 * 1024),
    "K": Decimal(1000) / (1024 * 1024),
    "M": Decimal(1000**2) / (1024 * 1024),
    "G": Decimal(1000**3) / (1024 * 1024),
    "T": Decimal(1000**4) / (1024 * 1024),
    "Ki": Decimal(1) / 1024,
    "Mi": Decimal(1),
    "Gi": Decimal(1024),
    "Ti": Decimal(1024 * 1024),
}
_WORD_RE = re.compile(r"[a-z0-9]+")
# Spec fields as the manifest names them: a refusal by the submission service names the manifest's.
SPEC_PATHS = {
    "name": "metadata.name",
    "image": f"{CONTAINER}.image",
    "command": f"{CONTAINER}.command",
    "env": f"{CONTAINER}.env",
    "gpu_count": f'{CONTAINER}.resources.limits["{GPU}"]',
    "gpu_models": f'{CONTAINER}.resources.limits["{GPU_MODEL}"]',
    "cpu_millicores": f"{CONTAINER}.resources.limits.cpu",
    "ram_mib": f"{CONTAINER}.resources.limits.memory",
    "region": f'spec.template.spec.nodeSelector["{REGION_LABEL}"]',
    "array": "spec.completions",
    "max_retries": "spec.backoffLimit",
    "max_runtime_s": "spec.activeDeadlineSeconds",
}


def is_manifest(data: Any) -> bool:
    """Whether a parsed body is a Kubernetes object (``apiVersion`` and ``kind``), not a job spec."""
    return isinstance(data, dict) and "apiVersion" in data and "kind" in data


@dataclass
class Translation:
    spec: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def _refuse(path: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{path}: {message}", fields={path: [message]})


def _mapping(value: Any, path: str, *, required: bool = False) -> dict:
    if value is None and not required:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _refuse(path, "Must be a mapping with string keys.")
    return value


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _refuse(path, f"Must be an integer from {lo} to {hi}.")
    return value


def _strings(value: Any, path: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(path, "Must be a list of strings.")
    return value


def _quantity(value: Any, path: str, pattern: re.Pattern) -> re.Match:
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    m = pattern.match(text) if isinstance(text, str) else None
    if m is None:
        raise _refuse(path, "Not a quantity this portal reads (e.g. cpu: 500m or 4, memory: 16Gi).")
    return m


def _cpu_millicores(value: Any, path: str) -> int:
    number, milli = _quantity(value, path, _CPU_RE).groups()
    millicores = Decimal(number) if milli else Decimal(number) * 1000
    if millicores != millicores.to_integral_value() or millicores < 1:
        raise _refuse(path, "At least 1m, in whole millicores.")
    return int(millicores)


def _ram_mib(value: Any, path: str) -> int:
    number, unit = _quantity(value, path, _MEM_RE).groups()
    try:
        mib = (Decimal(number) * _MEM_MIB[unit]).to_integral_value(rounding="ROUND_CEILING")
    except InvalidOperation:
        raise _refuse(path, "Too large.") from None
    return int(mib)


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def gpu_models_matching(value: Any, path: str) -> list[str]:
    """The catalog models (by name) one of whose names contains ``value`` as whole words: ``A100``
    every A100, ``NVIDIA-A100-SXM4-80GB`` that one; none is a 400 naming ``path``."""
    needle = _words(value) if isinstance(value, str) and len(value) <= 80 else []
    if not needle:
        raise _refuse(path, "A GPU model name, e.g. A100 or NVIDIA-A100-SXM4-80GB.")
    out = []
    for m in GpuModel.objects.only("name", "short_name", "aliases"):
        names = (m.name, m.short_name, *(a for a in (m.aliases or []) if isinstance(a, str)))
        if any(_contains(_words(n), needle) for n in names if n):
            out.append(m.name)
    if not out:
        raise _refuse(path, f"No GPU model in the catalog is called {value!r}; see /api/v1/gpu-types/.")
    return out


def _unsupported(obj: dict, path: str, known: set[str], warnings: list[str]) -> None:
    for key in obj:
        if key not in known:
            warnings.append(
                f"{path}.{key}: not supported here; ignored."
                if path
                else f"{key}: not supported here; ignored."
            )


def _container(c: Any, spec: dict, warnings: list[str]) -> dict:
    c = _mapping(c, CONTAINER, required=True)
    if not isinstance(c.get("image"), str) or not c["image"]:
        raise _refuse(f"{CONTAINER}.image", "Required: the container's image.")
    spec["image"] = c["image"]
    command = _strings(c.get("command"), f"{CONTAINER}.command")
    args = _strings(c.get("args"), f"{CONTAINER}.args")
    if command or args:
        spec["command"] = command + args
    if command:
        warnings.append(
            f"{CONTAINER}.command: runs as the image's CMD (with args after it); an ENTRYPOINT the image "
            "has still runs first."
        )
    if c.get("envFrom") is not None:
        raise _refuse(f"{CONTAINER}.envFrom", "Not supported: give each variable's value in env.")
    env = c.get("env")
    if env is not None:
        if not isinstance(env, list):
            raise _refuse(f"{CONTAINER}.env", "Must be a list of {name, value}.")
        spec["env"] = {}
        for i, item in enumerate(env):
            path = f"{CONTAINER}.env[{i}]"
            item = _mapping(item, path, required=True)
            if "valueFrom" in item:
                raise _refuse(
                    f"{path}.valueFrom", "Not supported: give the value (or a secret in a JSON spec)."
                )
            if not isinstance(item.get("name"), str) or set(item) - {"name", "value"}:
                raise _refuse(path, "Must be {name, value}.")
            value = item.get("value") or ""  # Kubernetes' default: empty
            if not isinstance(value, str):
                raise _refuse(f"{path}.value", "Must be a string (quote numbers and booleans).")
            spec["env"][item["name"]] = value
    _resources(_mapping(c.get("resources"), f"{CONTAINER}.resources"), spec, warnings)
    _unsupported(c, CONTAINER, {"name", "image", "command", "args", "env", "resources"}, warnings)
    return spec


def _resources(res: dict, spec: dict, warnings: list[str]) -> None:
    base = f"{CONTAINER}.resources"
    limits = _mapping(res.get("limits"), f"{base}.limits")
    requests = _mapping(res.get("requests"), f"{base}.requests")
    _unsupported(res, base, {"limits", "requests"}, warnings)
    for name in sorted(set(limits) | set(requests)):
        where = "limits" if name in limits else "requests"
        value = limits[name] if name in limits else requests[name]
        path = f'{base}.{where}["{name}"]'
        if name in limits and name in requests and str(limits[name]) != str(requests[name]):
            warnings.append(f'{base}.requests["{name}"]: the limit ({limits[name]}) is what is reserved.')
        if name == GPU:
            count = int(value) if isinstance(value, str) and value.isdigit() else value
            spec["gpu_count"] = _int(count, path, 1, 10_000)
        elif name == GPU_MODEL:
            spec["gpu_models"] = gpu_models_matching(value, path)
        elif name == "cpu":
            spec["cpu_millicores"] = _cpu_millicores(value, path)
        elif name == "memory":
            spec["ram_mib"] = _ram_mib(value, path)
        elif "/" in name:  # another device (amd.com/gpu, a NIC): running without it is not this job
            raise _refuse(path, "Not a resource this portal provides.")
        else:
            warnings.append(f"{path}: not reserved here; ignored.")
    if "gpu_count" not in spec:
        raise _refuse(f'{base}.limits["{GPU}"]', "Required: the number of GPUs.")


def _pod(pod: dict, spec: dict, warnings: list[str]) -> None:
    base = "spec.template.spec"
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        raise _refuse(f"{base}.containers", "Required: a list with the container to run.")
    _container(containers[0], spec, warnings)
    for i in range(1, len(containers)):
        warnings.append(f"{base}.containers[{i}]: only the first container runs; ignored.")
    if pod.get("restartPolicy", "Never") not in ("Never", "OnFailure"):
        raise _refuse(f"{base}.restartPolicy", "A Job's is Never or OnFailure (retries: spec.backoffLimit).")
    selector = _mapping(pod.get("nodeSelector"), f"{base}.nodeSelector")
    for key, value in selector.items():
        path = f'{base}.nodeSelector["{key}"]'
        if key == GPU_PRODUCT:
            if "gpu_models" in spec:
                raise _refuse(path, f'Give the model once (resources.limits["{GPU_MODEL}"] has it).')
            spec["gpu_models"] = gpu_models_matching(value, path)
        elif key == REGION_LABEL:
            if not isinstance(value, str):
                raise _refuse(path, "A region code, e.g. us-east-1.")
            spec["region"] = value
        else:
            # Any other label: a node selector on the labels agents register (checked by the service).
            spec.setdefault("node_selector", {})[key] = value
    _unsupported(pod, base, {"containers", "restartPolicy", "nodeSelector"}, warnings)


def _job(job: dict, spec: dict, warnings: list[str]) -> None:
    completions = job.get("completions")
    parallelism = job.get("parallelism")
    if completions is not None:
        completions = _int(completions, "spec.completions", 1, 1_000_000)
    if parallelism is not None:
        parallelism = _int(parallelism, "spec.parallelism", 1, 1_000_000)
    if completions is None and parallelism not in (None, 1):
        # Kubernetes' work-queue pattern (pods coordinate among themselves until one succeeds).
        raise _refuse("spec.completions", "Required with parallelism above 1: the number of tasks.")
    if job.get("completionMode") not in (None, "NonIndexed", "Indexed"):
        raise _refuse("spec.completionMode", "NonIndexed or Indexed.")
    if completions is not None and completions > 1:
        # Kubernetes' default parallelism is 1.
        spec["array"] = {"count": completions, "parallelism": min(parallelism or 1, completions)}
        if job.get("completionMode") == "Indexed":
            warnings.append(
                "spec.completionMode: each task's index is GPUPOOL_ARRAY_INDEX (JOB_COMPLETION_INDEX "
                "is not set)."
            )
    if job.get("backoffLimit") is not None:
        spec["max_retries"] = _int(job["backoffLimit"], "spec.backoffLimit", 0, 100)
    if job.get("activeDeadlineSeconds") is not None:
        spec["max_runtime_s"] = _int(job["activeDeadlineSeconds"], "spec.activeDeadlineSeconds", 1, 2**31)
        if "array" in spec:
            warnings.append("spec.activeDeadlineSeconds: applies to each task of the array.")
    if job.get("suspend"):
        raise _refuse("spec.suspend", "Not supported: a job is queued when it is submitted.")
    known = {"template", "completions", "parallelism", "completionMode", "backoffLimit"}
    _unsupported(job, "spec", known | {"activeDeadlineSeconds", "suspend"}, warnings)


def manifest_translate(manifest: Any) -> Translation:
    """A ``batch/v1`` Job manifest as a job spec and the warnings for what it leaves out; a 400
    naming the manifest's field for what cannot be honoured."""
    manifest = _mapping(manifest, "(manifest)", required=True)
    if manifest.get("apiVersion") != "batch/v1":
        raise _refuse("apiVersion", "Must be batch/v1.")
    if manifest.get("kind") != "Job":
        raise _refuse("kind", "Must be Job.")
    spec: dict[str, Any] = {}
    warnings: list[str] = []
    meta = _mapping(manifest.get("metadata"), "metadata")
    if meta.get("name") is not None:
        if not isinstance(meta["name"], str):
            raise _refuse("metadata.name", "Must be a string.")
        spec["name"] = meta["name"]
    _unsupported(meta, "metadata", {"name"}, warnings)
    _unsupported(manifest, "", {"apiVersion", "kind", "metadata", "spec", "status"}, warnings)
    job = _mapping(manifest.get("spec"), "spec", required=True)
    template = _mapping(job.get("template"), "spec.template", required=True)
    _unsupported(template, "spec.template", {"spec"}, warnings)
    _pod(_mapping(template.get("spec"), "spec.template.spec", required=True), spec, warnings)
    _job(job, spec, warnings)
    return Translation(spec=spec, warnings=warnings)


def manifest_error(exc: ValidationFailed) -> ValidationFailed:
    """A refusal of the translated spec, its fields named as the manifest names them."""
    fields = {SPEC_PATHS.get(k, k): v for k, v in exc.fields.items()}
    message = exc.message
    for key, path in SPEC_PATHS.items():
        if message.startswith(f"{key}:"):
            message = path + message[len(key) :]
            break
    return ValidationFailed(message, fields=fields, code=exc.code)
