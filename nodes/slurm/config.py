"""A Slurm region's configuration (``Region.slurm``), validated once here and used as a dataclass.

Staff write it (Django admin or ``manage.py slurm_region``); every value is checked, because each
ends up in an argv or a path: partition, QOS and GRES type names are Slurm identifiers, paths are
absolute. Keys::

    connector      "cli": Slurm's commands with --json, run where the portal runs, which must be
                   a Slurm client host (a login node, or munge key + slurm.conf); or "rest":
                   slurmrestd's OpenAPI v0.0.38 (Slurm 22.05 to 23.02) over HTTP with a JWT
    slurm_conf     (cli) absolute path of the slurm.conf the commands read (SLURM_CONF); optional
    rest_url       (rest) slurmrestd's base URL, http(s)://host[:port] (no path, user or query)
    rest_user      (rest) the Slurm user the token is for (X-SLURM-USER-NAME): it submits the jobs
    jwt_file       (rest) absolute path of a file holding the token (X-SLURM-USER-TOKEN), read at
                   every sync so it can be rotated without touching the region; never stored
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
REST_KEYS = ("rest_url", "rest_user", "jwt_file")
URL_RE = re.compile(r"^https?://[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?/?$")
KEYS = {
    "connector",
    "slurm_conf",
    *REST_KEYS,
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
    connector: str = "cli"
    rest_url: str = ""
    rest_user: str = ""
    jwt_file: str = ""
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


def _rest(data: dict) -> dict[str, str]:
    """The rest connector's keys, checked: the URL the portal fetches is staff's, yet checked as
    any URL (scheme, host, port; nothing else)."""
    if data.get("slurm_conf"):
        raise ValidationFailed(
            "slurm_conf is for the cli connector (slurmrestd reads its own).",
            fields={"slurm_conf": ["Only with connector 'cli'."]},
        )
    url = data.get("rest_url")
    if not isinstance(url, str) or not URL_RE.fullmatch(url):
        raise ValidationFailed(
            "rest_url must be slurmrestd's http(s)://host[:port].",
            fields={"rest_url": ["http(s)://host[:port], no path, user or query."]},
        )
    user = data.get("rest_user")
    if not isinstance(user, str) or not NAME_RE.fullmatch(user):
        raise ValidationFailed("rest_user is not a Slurm user name.", fields={"rest_user": ["A user name."]})
    jwt_file = _path(data.get("jwt_file"), "jwt_file")
    if not jwt_file:
        raise ValidationFailed(
            "jwt_file is required: the file holding slurmrestd's token.",
            fields={"jwt_file": ["Absolute path."]},
        )
    return {"rest_url": url.rstrip("/"), "rest_user": user, "jwt_file": jwt_file}


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
    if connector not in ("cli", "rest"):
        raise ValidationFailed(
            "connector is 'cli' (Slurm's commands on this host) or 'rest' (slurmrestd).",
            fields={"connector": ["'cli' or 'rest'."]},
        )
    rest = _rest(data) if connector == "rest" else {}
    if connector == "cli" and any(k in data for k in REST_KEYS):
        raise ValidationFailed(
            "rest_url, rest_user and jwt_file are for the rest connector.",
            fields={k: ["Only with connector 'rest'."] for k in REST_KEYS if k in data},
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
        connector=connector,
        **rest,
        slurm_conf=_path(data.get("slurm_conf"), "slurm_conf"),
        partitions=_names(data.get("partitions", {}), "partitions", (*PLANS, "default")),
        gres_types=gres,
        qos=_names(data.get("qos", {}), "qos", PLANS),
        account_prefix=prefix,
        output_dir=output_dir,
        timeout_s=timeout,
    )
