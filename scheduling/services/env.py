"""A workload's environment as the portal stores it: each value a string, or a reference to one of
the tenant's secrets, ``{"secret": "NAME"}``. References are kept as they are (a stored workload
or template never holds a secret's value) and replaced by the values only in the start command
the node receives (``env_resolve``, called from the command delivery)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodes.agent.workload_rules import WorkloadRuleError, check_env
from portal.errors import ValidationFailed
from portal.services.secrets import secret_name_check, secrets_missing, secrets_resolve


def _fail(message: str) -> ValidationFailed:
    return ValidationFailed(f"env: {message}", fields={"env": [message]})


def secret_refs(env: Mapping[str, Any]) -> dict[str, str]:
    """Variable name -> secret name, for the variables that refer to a secret."""
    return {k: v["secret"] for k, v in env.items() if isinstance(v, Mapping)}


def env_validate(raw: Any, *, tenant, secrets_allowed: bool = True) -> dict[str, Any]:
    """The env of a request or template, checked: the workload rules for names and values (a
    reference counts by its variable's name), every reference well formed and, with a tenant,
    naming a secret it has. Returns a new dict in the given order."""
    if not isinstance(raw, Mapping):
        raise _fail('Must be an object of strings or secret references ({"secret": "NAME"}).')
    refs: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            if not secrets_allowed:
                raise _fail(f"{key}: only text values here (no secret references).")
            name = value.get("secret")
            if set(value) != {"secret"} or not isinstance(name, str):
                raise _fail(f'{key}: a secret reference is {{"secret": "NAME"}}.')
            try:
                secret_name_check(name)
            except ValidationFailed:
                raise _fail(f"{key}: {name!r} is not a secret name.") from None
            refs[key] = name
    try:
        checked = check_env({k: ("" if k in refs else v) for k, v in raw.items()})
    except WorkloadRuleError as exc:
        raise _fail(exc.message) from None
    if tenant is not None:
        missing = secrets_missing(tenant=tenant, names=refs.values())
        if missing:
            raise _fail(f"You have no secret named {missing[0]!r}: create it first (/api/v1/secrets/).")
    return {k: ({"secret": refs[k]} if k in refs else checked[k]) for k in checked}


def env_resolve(env: Mapping[str, Any], *, tenant_id: int) -> dict[str, str]:
    """The env with each reference replaced by its secret's value (``SecretMissing`` when one is
    gone). Only for the start command on its way to the node: never store the result."""
    refs = secret_refs(env)
    if not refs:
        return dict(env)
    values = secrets_resolve(tenant_id=tenant_id, names=refs.values())
    return {k: (values[refs[k]] if k in refs else v) for k, v in env.items()}


def _with_work_token(payload: dict[str, Any]) -> dict[str, Any]:
    """A work-queue worker's token (``scheduling.services.work``), signed for this placement's
    task and attempt as it leaves for the node: never stored with the command."""
    from scheduling.services.orphans import workload_id_of
    from scheduling.services.work import WORK_TOKEN_ENV, WORK_URL_ENV, work_token_for

    platform = payload.get("platform_env")
    if not isinstance(platform, Mapping) or WORK_URL_ENV not in platform:
        return payload
    wid = workload_id_of(payload.get("workload_id"))
    attempt = payload.get("attempt")
    if wid is None or not isinstance(attempt, int):
        return payload
    return {
        **payload,
        "platform_env": {**platform, WORK_TOKEN_ENV: work_token_for(task_id=wid, attempt=attempt)},
    }


def start_payload_for_node(payload: dict[str, Any]) -> dict[str, Any]:
    """A stored start command's payload as its node receives it: secret references resolved for
    the workload's tenant (``nodes.services.commands.wire_payload_register``) and its volumes'
    sizes as they are now. A secret gone since submission fails the start, naming it."""
    from nodes.services.commands import PayloadRefused
    from portal.services.secrets import SecretMissing
    from scheduling.models import Workload
    from scheduling.services.orphans import workload_id_of
    from scheduling.services.volumes import volume_sizes_for_payload

    payload = _with_work_token(payload)
    volumes = payload.get("volumes")
    if isinstance(volumes, list) and volumes:  # each volume's size as it is now (a resize counts)
        payload = {**payload, "volumes": volume_sizes_for_payload(volumes)}
    env = payload.get("env") or {}
    if not isinstance(env, Mapping) or not secret_refs(env):
        return payload
    wid = workload_id_of(payload.get("workload_id"))
    tenant_id = Workload.objects.filter(pk=wid).values_list("tenant_id", flat=True).first() if wid else None
    if tenant_id is None:
        raise PayloadRefused("The workload no longer exists.")
    try:
        resolved = env_resolve(env, tenant_id=tenant_id)
    except SecretMissing as exc:
        raise PayloadRefused(f"{exc.message} The workload's env refers to it.") from None
    return {**payload, "env": resolved}


# Names the cycle's ``_platform_env`` sets for a gang member; a gang's own env may not set them.
GANG_ENV_NAMES = ("WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
