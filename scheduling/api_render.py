"""The workload API's answers built directly, as plain dicts: a list page's rows (``values()``)
and a detail's instance render here, key by key as ``scheduling.api``'s ``WorkloadSerializer``,
``WorkloadDetailSerializer`` and ``AccessSerializer`` fields render them, without DRF's
per-request copy of the fields and per-field lookups. tests/scheduling/test_api_rendering.py
compares the two for every shape of workload."""

from __future__ import annotations

from rest_framework import serializers

from scheduling.models import Workload, WorkloadState

# Decimal and date-time values render through DRF's own fields, made once: the same text as the
# serializers' fields give (places from the model, the active time zone, "Z" for UTC).
_WEIGHT = serializers.DecimalField(
    max_digits=Workload._meta.get_field("min_compute_weight").max_digits,
    decimal_places=Workload._meta.get_field("min_compute_weight").decimal_places,
    read_only=True,
)
_PRICE = serializers.DecimalField(
    max_digits=Workload._meta.get_field("spot_max_price").max_digits,
    decimal_places=Workload._meta.get_field("spot_max_price").decimal_places,
    read_only=True,
)
_TIME = serializers.DateTimeField(read_only=True)


def _int(value):
    return None if value is None else int(value)


def _time(value):
    return None if value is None else _TIME.to_representation(value)


def _decimal(field: serializers.DecimalField, value):
    return None if value is None else field.to_representation(value)


def _str(value):
    return None if value is None else str(value)


def access_json(access: dict) -> dict:
    """``workload_access``'s answer as ``AccessSerializer`` renders it (its keys only), built directly."""
    ssh, link = access["ssh"], access["share_link"]
    return {
        "ssh": None
        if ssh is None
        else {
            "host": str(ssh["host"]),
            "port": int(ssh["port"]),
            "user": str(ssh["user"]),
            "command": str(ssh["command"]),
            "known_hosts": str(ssh["known_hosts"]),
        },
        "ssh_unavailable_reason": str(access["ssh_unavailable_reason"]),
        "ports": [
            {
                "port": int(p["port"]),
                "protocol": str(p["protocol"]),
                "host_port": _int(p["host_port"]),
                "host": _str(p["host"]),
                "url": _str(p["url"]),
                "note": str(p["note"]),
            }
            for p in access["ports"]
        ],
        "share_link": None if link is None else {"created_at": _time(link["created_at"])},
    }


# What a workload's list entry reads, as ``values()`` names: the list pages fetch these rows
# (``_WorkloadViewSet.list``), not model instances; a detail turns its instance into one.
LIST_COLUMNS = (
    "id",
    "kind",
    "name",
    "state",
    "state_reason",
    "pending_reason",
    "pending_message",
    "expected_start_at",
    "min_gpu_memory_gib",
    "min_compute_weight",
    "gpu_vendor",
    "cuda_capability",
    "rocm_target",
    "min_driver",
    "min_cuda",
    "min_rocm",
    "gpu_count",
    "gang",
    "gpus_per_node",
    "split_regions_ok",
    "node_selector",
    "affinity",
    "anti_affinity",
    "spread",
    "preference",
    "gpu_fraction_milli",
    "mig_profile",
    "cpu_millicores",
    "ram_mib",
    "other_regions_ok",
    "plan",
    "spot_max_price",
    "reservation_id",
    "priority_class",
    "image",
    "template",
    "command",
    "env",
    "ports",
    "ssh_public_key",
    "max_runtime_s",
    "estimated_runtime_s",
    "requeue_on_preemption",
    "checkpoint_resume",
    "max_retries",
    "retries",
    "attempt",
    "exit_code",
    "elastic_min_gpus",
    "elastic_max_gpus",
    "elastic_target_gpus",
    "elastic_on_resize",
    "array_count",
    "array_parallelism",
    "array_parent_id",
    "array_index",
    "submitted_at",
    "scheduled_at",
    "started_at",
    "finished_at",
)
LIST_VALUES = (*LIST_COLUMNS, "region__code")


def workload_row(w: Workload) -> dict:
    """One workload instance as the list's ``values(*LIST_VALUES)`` row."""
    row = {name: getattr(w, name) for name in LIST_COLUMNS}
    row["region__code"] = None if w.region is None else w.region.code
    return row


def workload_json(row: dict, gpu_models: list[str]) -> dict:
    """A workload's list entry from its row, key by key as ``WorkloadSerializer``'s fields render."""
    state = row["state"]
    pending = None
    if state in (WorkloadState.PENDING, WorkloadState.QUEUED):
        pending = {
            "reason": row["pending_reason"] or "queued",
            "message": row["pending_message"],
            "expected_start_at": row["expected_start_at"],
        }
    elastic = None
    if row["elastic_min_gpus"] is not None:
        elastic = {
            "min_gpus": row["elastic_min_gpus"],
            "max_gpus": row["elastic_max_gpus"],
            "target_gpus": row["elastic_target_gpus"],
            "on_resize": row["elastic_on_resize"] or "signal",
        }
    return {
        "id": _int(row["id"]),
        "kind": str(row["kind"]),
        "name": str(row["name"]),
        "state": str(state),
        "state_reason": str(row["state_reason"]),
        "pending": pending,
        "gpu_models": gpu_models,
        "min_gpu_memory_gib": int(row["min_gpu_memory_gib"]),
        "min_compute_weight": _decimal(_WEIGHT, row["min_compute_weight"]),
        "gpu_vendor": str(row["gpu_vendor"]),
        "cuda_capability": str(row["cuda_capability"]),
        "rocm_target": str(row["rocm_target"]),
        "min_driver": str(row["min_driver"]),
        "min_cuda": str(row["min_cuda"]),
        "min_rocm": str(row["min_rocm"]),
        "gpu_count": int(row["gpu_count"]),
        "gang": bool(row["gang"]),
        "gpus_per_node": row["gpus_per_node"],
        "split_regions_ok": bool(row["split_regions_ok"]),
        "node_selector": row["node_selector"],
        "affinity": row["affinity"],
        "anti_affinity": row["anti_affinity"],
        "spread": row["spread"],
        "preference": str(row["preference"]),
        "gpu_fraction_milli": int(row["gpu_fraction_milli"]),
        "mig_profile": str(row["mig_profile"]),
        "cpu_millicores": int(row["cpu_millicores"]),
        "ram_mib": int(row["ram_mib"]),
        "region": row["region__code"],
        "other_regions_ok": bool(row["other_regions_ok"]),
        "plan": str(row["plan"]),
        "spot_max_price": _decimal(_PRICE, row["spot_max_price"]),
        "reservation": row["reservation_id"],
        "priority_class": str(row["priority_class"]),
        "image": str(row["image"]),
        "template": str(row["template"]),
        "command": row["command"],
        "env": row["env"],
        "ports": row["ports"],
        "ssh_public_key": str(row["ssh_public_key"]),
        "max_runtime_s": _int(row["max_runtime_s"]),
        "estimated_runtime_s": _int(row["estimated_runtime_s"]),
        "requeue_on_preemption": bool(row["requeue_on_preemption"]),
        "checkpoint_resume": bool(row["checkpoint_resume"]),
        "max_retries": int(row["max_retries"]),
        "retries": int(row["retries"]),
        "attempt": int(row["attempt"]),
        "exit_code": _int(row["exit_code"]),
        "elastic": elastic,
        "array_count": _int(row["array_count"]),
        "array_parallelism": _int(row["array_parallelism"]),
        "array_parent": row["array_parent_id"],
        "array_index": _int(row["array_index"]),
        "submitted_at": _time(row["submitted_at"]),
        "scheduled_at": _time(row["scheduled_at"]),
        "started_at": _time(row["started_at"]),
        "finished_at": _time(row["finished_at"]),
    }
