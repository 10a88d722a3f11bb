"""A Slurm region's configuration (``Region.slurm``), validated once here and used as a dataclass.

Staff write it (Django admin or ``manage.py slurm_region``); every value is checked, because each
ends up in an argv or a path: partition, QOS and GRES type names are Slurm identifiers, paths are
absolute. Keys::

    connector      "cli" (the only one: Slurm's commands with --json, run where the portal runs,
                   which must be a Slurm client host: a login node, or munge key + slurm.conf)
    slurm_conf     absolute path of the slurm.conf the commands read (SLURM_CONF); optional
    partitions     plan -> partition ("on_demand", "spot", "reserved"; "default" for the rest)
    gres_types     catalog GPU model name -> GRES type ("NVIDIA H100 80GB HBM3": "h100")
    qos            priority class -> QOS ("reserved", "on_demand", "spot"); optional
    account_prefix prefix of the Slurm account made per tenant (default "gp-")
    output_dir     absolute directory for job output, readable by the portal (shared filesystem)
    timeout_s      seconds a Slurm command may take (default 30)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from portal.errors import ValidationFailed

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PATH_RE = re.compile(r"^/[A-Za-z0-9_./-]{0,254}$")
PLANS = ("on_demand", "spot", "reserved")
KEYS = {
    "connector",
    "slurm_conf",
    "partitions",
    "gres_types",
    "qos",
    "account_prefix",
    "output_dir",
    "timeout_s",
}


@dataclass(frozen=True)
class SlurmConfig:
    slurm_conf: str = ""
    partitions: dict[str, str] = field(default_factory=dict)
    gres_types: dict[str, str] = field(default_factory=dict)
    qos: dict[str, str] = field(default_factory=dict)
    account_prefix: str = "gp-"
    output_dir: str = ""
    timeout_s: int = 30

    def partition(self, plan: str) -> str:
        return self.partitions.get(plan) or self.partitions.get("default", "")

    def model_of_type(self, gres_type: str) -> str | None:
        """The catalog model name a GRES type stands for (None: not mapped)."""
        for name, t in self.gres_types.items():
            if t == gres_type:
                return name
        return None


def _names(value: Any, field_name: str, keys: tuple[str, ...] | None) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValidationFailed(f"{field_name} must be an object.", fields={field_name: ["Not an object."]})
    out = {}
    for k, v in value.items():
        if keys is not None and k not in keys:
            raise ValidationFailed(
                f"{field_name} has an unknown key {k!r}.", fields={field_name: [f"Keys: {', '.join(keys)}."]}
            )
        if not isinstance(v, str) or not NAME_RE.fullmatch(v):
            raise ValidationFailed(
                f"{field_name}[{k!r}] is not a Slurm name.",
                fields={field_name: ["Letters, digits, '_', '.', '-'; at most 64."]},
            )
        out[str(k)] = v
    return out


def _path(value: Any, field_name: str) -> str:
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or not PATH_RE.fullmatch(value) or "/../" in value + "/" or "/./" in value:
        raise ValidationFailed(
            f"{field_name} must be an absolute path.", fields={field_name: ["Absolute path."]}
        )
    return value


def slurm_config_parse(data: Any, *, model_names: set[str] | None = None) -> SlurmConfig:
    """The checked configuration of ``data``, or a ValidationFailed naming the key and why.
    ``model_names``: the catalog's model names, where the caller checks ``gres_types`` against it."""
    if not isinstance(data, dict):
        raise ValidationFailed("slurm must be an object.", fields={"slurm": ["Not an object."]})
    unknown = set(data) - KEYS
    if unknown:
        raise ValidationFailed(
            f"slurm has unknown keys: {', '.join(sorted(unknown))}.",
            fields={"slurm": [f"Keys: {sorted(KEYS)}."]},
        )
    connector = data.get("connector", "cli")
    if connector != "cli":
        raise ValidationFailed(
            "Only the cli connector is supported (Slurm's commands on this host).",
            fields={"connector": ["Must be 'cli'."]},
        )
    gres = _names(data.get("gres_types", {}), "gres_types", None)
    if model_names is not None:
        missing = sorted(set(gres) - model_names)
        if missing:
            raise ValidationFailed(
                f"gres_types names models not in the catalog: {', '.join(missing)}.",
                fields={"gres_types": ["Catalog model names."]},
            )
    prefix = data.get("account_prefix", "gp-")
    if not isinstance(prefix, str) or not re.fullmatch(r"[a-z0-9_-]{0,16}", prefix):
        raise ValidationFailed(
            "account_prefix is not valid.", fields={"account_prefix": ["[a-z0-9_-], at most 16."]}
        )
    timeout = data.get("timeout_s", 30)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or not 1 <= timeout <= 300:
        raise ValidationFailed("timeout_s must be 1..300.", fields={"timeout_s": ["An integer, 1 to 300."]})
    output_dir = _path(data.get("output_dir"), "output_dir")
    if not output_dir:
        raise ValidationFailed("output_dir is required.", fields={"output_dir": ["Absolute directory."]})
    return SlurmConfig(
        slurm_conf=_path(data.get("slurm_conf"), "slurm_conf"),
        partitions=_names(data.get("partitions", {}), "partitions", (*PLANS, "default")),
        gres_types=gres,
        qos=_names(data.get("qos", {}), "qos", PLANS),
        account_prefix=prefix,
        output_dir=output_dir,
        timeout_s=timeout,
    )
