"""Workload templates: the catalog staff manage (``tenant`` empty) and each tenant's own.

``template_apply`` is what launching by template means: at submission, the template fills the
request's image, command, ports (instances only: jobs publish none), env (the request's variables
win, name by name), minimum GPU memory and the mount path of the request's first volume wherever
the request does not set them, so the stored workload carries a real image and its own copy of
everything it runs with. A template with ``volume_required`` (it keeps its data on a volume, at
``volume_mount_path``) is launched only with a volume: without one the launch is a 400 naming
``volumes``. A tenant's template
is found before the catalog's; a tenant cannot name one of its own like a catalog template.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from nodes.agent.workload_rules import (
    WorkloadRuleError,
    check_command,
    check_image,
    check_mount_path,
    check_ports,
    check_template,
)
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.services.audit import audit_record
from scheduling.models import WorkloadKind, WorkloadTemplate
from scheduling.services.env import env_validate

EDITABLE = (
    "name",
    "description",
    "image",
    "command",
    "ports",
    "env",
    "min_gpu_memory_gib",
    "volume_mount_path",
    "volume_required",
)
MAX_DESCRIPTION = 2000


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def _rule(check, value):
    try:
        return check(value)
    except WorkloadRuleError as exc:
        raise _fail(exc.field, exc.message) from None


def template_fields_check(data: dict[str, Any], *, tenant, partial: bool = False) -> dict[str, Any]:
    """The editable fields of a template, each checked by the rules a workload's own field obeys
    (the image as an OCI reference, ...). A catalog template's env holds text only; a tenant's may
    refer to that tenant's secrets."""
    unknown = sorted(set(data) - set(EDITABLE))
    if unknown:
        raise _fail(unknown[0], "Not a template field.")
    out: dict[str, Any] = {}
    if "name" in data or not partial:
        name = data.get("name")
        if not name:
            raise _fail("name", "Required.")
        try:
            out["name"] = check_template(name)
        except WorkloadRuleError as exc:
            raise _fail("name", exc.message) from None
    if "description" in data:
        text = data["description"]
        if not isinstance(text, str) or len(text) > MAX_DESCRIPTION:
            raise _fail("description", f"Text of at most {MAX_DESCRIPTION} characters.")
        out["description"] = text
    if "image" in data or not partial:
        out["image"] = _rule(check_image, data.get("image", ""))
    if "command" in data:
        out["command"] = _rule(check_command, data["command"])
    if "ports" in data:
        out["ports"] = _rule(check_ports, data["ports"])
    if "env" in data:
        out["env"] = env_validate(data["env"], tenant=tenant, secrets_allowed=tenant is not None)
    if "min_gpu_memory_gib" in data:
        gib = data["min_gpu_memory_gib"]
        if isinstance(gib, bool) or not isinstance(gib, int) or not 0 <= gib <= 4096:
            raise _fail("min_gpu_memory_gib", "An integer between 0 and 4096.")
        out["min_gpu_memory_gib"] = gib
    if "volume_mount_path" in data:
        path = data["volume_mount_path"]
        out["volume_mount_path"] = "" if path in (None, "") else _rule(check_volume_path, path)
    if "volume_required" in data:
        if not isinstance(data["volume_required"], bool):
            raise _fail("volume_required", "true or false.")
        out["volume_required"] = data["volume_required"]
    return out


def check_volume_path(value: Any) -> str:
    return check_mount_path(value, field="volume_mount_path")


def _check_volume_pair(*, required: bool, path: str) -> None:
    if required and not path:
        raise _fail("volume_mount_path", "A template that needs a volume says where it is mounted.")


def _check_name_free(*, tenant, name: str, exclude: int | None = None) -> None:
    if tenant is not None and WorkloadTemplate.objects.catalog().filter(name=name).exists():
        raise _fail("name", f"{name!r} is a catalog template's name; choose another.")
    taken = WorkloadTemplate.objects.filter(name=name, tenant=tenant).exclude(pk=exclude)
    if taken.exists():
        raise _fail("name", f"You already have a template named {name!r}.")


def template_check(*, tenant, data: dict[str, Any], exclude: int | None = None) -> dict[str, Any]:
    """The checks of a create (``exclude`` None) or of a change to template ``exclude``, without
    saving: the admin's form shows their errors on its fields."""
    fields = template_fields_check(data, tenant=tenant, partial=exclude is not None)
    if "name" in fields:
        _check_name_free(tenant=tenant, name=fields["name"], exclude=exclude)
    current = WorkloadTemplate.objects.filter(pk=exclude).first() if exclude is not None else None
    _check_volume_pair(
        required=fields.get("volume_required", current.volume_required if current else False),
        path=fields.get("volume_mount_path", current.volume_mount_path if current else ""),
    )
    return fields


def template_create(*, tenant, data: dict[str, Any], actor: Actor) -> WorkloadTemplate:
    """A tenant's own template, or a catalog template when ``tenant`` is None (staff)."""
    fields = template_fields_check(data, tenant=tenant)
    _check_name_free(tenant=tenant, name=fields["name"])
    _check_volume_pair(
        required=fields.get("volume_required", False), path=fields.get("volume_mount_path", "")
    )
    now = timezone.now()
    try:
        with transaction.atomic():
            template = WorkloadTemplate.objects.create(
                tenant=tenant, created_at=now, updated_at=now, **fields
            )
            audit_record(
                tenant=tenant,
                actor=actor,
                action="template.create",
                target=template,
                data=_audit_data(fields),
            )
    except IntegrityError:
        raise _fail("name", f"A template named {fields['name']!r} exists.") from None
    return template


def template_update(*, template: WorkloadTemplate, data: dict[str, Any], actor: Actor) -> WorkloadTemplate:
    fields = template_fields_check(data, tenant=template.tenant, partial=True)
    if "name" in fields and fields["name"] != template.name:
        _check_name_free(tenant=template.tenant, name=fields["name"], exclude=template.pk)
    _check_volume_pair(
        required=fields.get("volume_required", template.volume_required),
        path=fields.get("volume_mount_path", template.volume_mount_path),
    )
    for key, value in fields.items():
        setattr(template, key, value)
    template.updated_at = timezone.now()
    try:
        with transaction.atomic():
            template.save(update_fields=[*fields, "updated_at"])
            audit_record(
                tenant=template.tenant,
                actor=actor,
                action="template.update",
                target=template,
                data=_audit_data(fields),
            )
    except IntegrityError:
        raise _fail("name", f"A template named {fields['name']!r} exists.") from None
    return template


def template_delete(*, template: WorkloadTemplate, actor: Actor) -> None:
    """Workloads launched from it keep what it filled in; new launches by its name are refused."""
    with transaction.atomic():
        audit_record(
            tenant=template.tenant,
            actor=actor,
            action="template.delete",
            target=template,
            data={"name": template.name},
        )
        template.delete()


def _audit_data(fields: dict[str, Any]) -> dict[str, Any]:
    # What changed, by field; env by variable names only (a value may be sensitive).
    data = {k: v for k, v in fields.items() if k != "env"}
    if "env" in fields:
        data["env"] = sorted(fields["env"])
    return data


def template_for_launch(*, tenant, name: str) -> WorkloadTemplate:
    """The template a launch names: the tenant's own, else the catalog's; a 400 naming
    ``template`` when there is none."""
    found = {t.tenant_id is None: t for t in WorkloadTemplate.objects.available_to(tenant).filter(name=name)}
    template = found.get(False) or found.get(True)
    if template is None:
        raise _fail("template", f"No template named {name!r} (GET /api/v1/templates/ lists them).")
    return template


def template_apply(*, template: WorkloadTemplate, spec: dict[str, Any], kind: str) -> dict[str, Any]:
    """``spec`` with what it leaves unset filled from ``template`` (the module's docstring)."""
    out = dict(spec)
    if not out.get("image"):
        out["image"] = template.image
    if not out.get("command") and template.command:
        out["command"] = list(template.command)
    if kind == WorkloadKind.INSTANCE and not out.get("ports") and template.ports:
        out["ports"] = list(template.ports)
    own = spec.get("env")
    if template.env and (own is None or isinstance(own, dict)):  # anything else: env's own 400
        out["env"] = {**template.env, **(own or {})}
    if out.get("min_gpu_memory_gib") is None and template.min_gpu_memory_gib:
        out["min_gpu_memory_gib"] = template.min_gpu_memory_gib
    volumes = spec.get("volumes")
    if template.volume_required and volumes in (None, []):
        raise _fail(
            "volumes",
            f"Template {template.name!r} keeps its data on a volume (mounted at "
            f"{template.volume_mount_path}): name one of yours in volumes.",
        )
    if template.volume_mount_path and isinstance(volumes, list) and volumes:
        first = volumes[0]
        if isinstance(first, dict) and first.get("mount_path") in (None, ""):
            # Anything else malformed is volumes_validate's 400.
            out["volumes"] = [{**first, "mount_path": template.volume_mount_path}, *volumes[1:]]
    return out
