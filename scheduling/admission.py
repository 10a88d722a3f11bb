"""Admission checks: a registry other apps plug into (metering adds budget and suspension checks).

A check is a callable ``check(*, tenant, workload, actor) -> None`` that raises a
``portal.errors.DomainError`` (usually ``AdmissionRefused``) to refuse the workload. It runs inside
the submission's transaction, after the spec is validated and the quotas pass, on the unsaved
Workload (its ``gpu_models`` are in ``workload._spec_models``, every model it could land on in
``workload._spec_candidates``), so a refusal stores nothing.
Register from the plugging app's ``AppConfig.ready()``; registering the same function twice is a
no-op, so a re-run ``ready()`` does no harm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from portal.errors import DomainError

AdmissionCheck = Callable[..., Any]

_checks: list[AdmissionCheck] = []


class AdmissionRefused(DomainError):
    status_code = 403
    code = "admission_refused"


def register_admission_check(fn: AdmissionCheck) -> AdmissionCheck:
    """Add ``fn`` to the checks every submission runs (usable as a decorator)."""
    if fn not in _checks:
        _checks.append(fn)
    return fn


def unregister_admission_check(fn: AdmissionCheck) -> None:
    if fn in _checks:
        _checks.remove(fn)


def admission_checks() -> tuple[AdmissionCheck, ...]:
    return tuple(_checks)


def run_admission_checks(*, tenant, workload, actor) -> None:
    for check in tuple(_checks):
        check(tenant=tenant, workload=workload, actor=actor)
