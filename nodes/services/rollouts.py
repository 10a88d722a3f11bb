"""Rolling upgrades: staff start a campaign over the nodes a selector chooses; it upgrades them a
batch at a time and stops at the first failure.

The rule, in plain words:

- **Start** (``rollout_start``): the selector (GPU model, region, label ``key=value``, any of them)
  chooses the READY nodes that are in no other open campaign, fixed when the campaign starts (a
  ``RolloutStep`` each, by region then hostname). ``upgrade`` names an upgrade configured on the
  agents (their ``upgrades`` table): the portal sends the name only, never a command line.
- **Batches** (``rollout_advance``, beat): while a batch is in progress nothing new starts. Then the
  next batch takes up to ``batch_size`` pending nodes, region by region, as long as the region's
  nodes out of service (every node not READY, for whatever reason) stay within
  ``max_region_share`` of its nodes. A region whose share is full waits.
- **Drain**: the node is DRAINING (no new work) and its agent is told (``drain``); instances on it
  get the preemption notice at once, with the time left to the drain deadline; jobs may finish.
  At the deadline what is left is preempted with its plan's notice (jobs requeue elsewhere). Work
  that has not left ``ROLLOUT_DRAIN_GRACE_S`` after the deadline fails the step.
- **Upgrade, check, return**: an ``upgrade`` command, then a ``gpu_check``; each must succeed within
  ``step_timeout_s``. Then the node is READY again and its agent told (``undrain``).
- **First failure stops the campaign** (FAILED, the reason on it and on the step); the failed node
  stays drained for staff to look at. Nodes of that batch still draining are returned at once;
  those already upgrading finish their command. **Pause** starts no new batch (the current one
  finishes); **resume** goes on; **abort** cancels what has not started and returns nodes that were
  only draining. Start, pause, resume and abort are audited, and so is every node state change.

What runs on a node is scheduling's business, which nodes does not import: scheduling registers
how to count a node's work and give it notice (``rollout_drain_register``).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q
from django.utils import timezone

from nodes.locks import lock_node, lock_rollout, lock_rollout_steps
from nodes.models import (
    ACTIVE_STEP_STATES,
    OPEN_ROLLOUT_STATES,
    CommandKind,
    CommandState,
    GpuModel,
    Node,
    NodeCommand,
    NodeState,
    Region,
    RolloutCampaign,
    RolloutState,
    RolloutStep,
    RolloutStepState,
)
from nodes.services.commands import node_command_enqueue
from nodes.signals import node_ready, send_on_commit
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record

logger = logging.getLogger(__name__)

UPGRADE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
MAX_BATCH_SIZE = 1000
MAX_DRAIN_DEADLINE_S = 7 * 86400
MIN_STEP_TIMEOUT_S = 10
MAX_STEP_TIMEOUT_S = 86400
DEFAULT_STEP_TIMEOUT_S = 3600
# The key of the advance step's PostgreSQL advisory lock (a stable 32-bit number).
ADVANCE_LOCK_KEY = zlib.crc32(b"gpupool.nodes.rollout_advance")


# --- what scheduling tells us about a node's work ---------------------------------------------------


@dataclass(frozen=True)
class DrainHooks:
    """``work(node_ids)``: node id -> how many workloads it holds now. ``notice(node_id, deadline,
    final, reason)``: give the node's work notice (``final`` false: instances, to stop by the
    deadline; true: everything left, with its plan's notice); returns how many were given notice."""

    work: Callable[[list[int]], dict[int, int]]
    notice: Callable[..., int]


_hooks: list[DrainHooks] = []


def rollout_drain_register(
    *, work: Callable[[list[int]], dict[int, int]], notice: Callable[..., int]
) -> None:
    """Scheduling's answer to "what runs on these nodes" and "give it notice". One; again replaces it."""
    _hooks[:] = [DrainHooks(work=work, notice=notice)]


def _node_work(node_ids: list[int]) -> dict[int, int]:
    return _hooks[0].work(node_ids) if _hooks and node_ids else {}


def _give_notice(node_id: int, deadline: datetime, *, final: bool, reason: str) -> int:
    return _hooks[0].notice(node_id=node_id, deadline=deadline, final=final, reason=reason) if _hooks else 0


# --- start ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutSpec:
    """A campaign as staff asked for it, checked (``rollout_spec_clean``)."""

    name: str
    upgrade: str
    gpu_model: GpuModel | None
    region: Region | None
    label_key: str
    label_value: str
    batch_size: int
    max_region_share: Decimal
    drain_deadline_s: int
    step_timeout_s: int


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def _int(data: dict[str, Any], field: str, low: int, high: int, default: int | None = None) -> int:
    value = data.get(field, default)
    if value is None:
        raise _fail(field, "Required.")
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        else:
            raise _fail(field, f"A whole number from {low} to {high}.")
    if not low <= value <= high:
        raise _fail(field, f"A whole number from {low} to {high}.")
    return value


def _share(value: Any) -> Decimal:
    """A fraction (0.25) or a percentage ("25%") of a region; more than 0, at most all of it."""
    if value is None or value == "":
        raise _fail("max_region_share", 'Required: a fraction like 0.25 or a percentage like "25%".')
    if isinstance(value, bool) or not isinstance(value, (int, str, Decimal, float)):
        raise _fail("max_region_share", 'A fraction like 0.25 or a percentage like "25%".')
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        share = Decimal(text[:-1].strip() if percent else text)
    except InvalidOperation:
        raise _fail("max_region_share", 'A fraction like 0.25 or a percentage like "25%".') from None
    if not share.is_finite():
        raise _fail("max_region_share", 'A fraction like 0.25 or a percentage like "25%".')
    if percent:
        share /= 100
    if not Decimal(0) < share <= Decimal(1) or share != share.quantize(Decimal("0.001")):
        raise _fail("max_region_share", "More than 0 and at most 1 (100%), to three decimal places.")
    return share.quantize(Decimal("0.001"))


def rollout_spec_clean(data: Any) -> RolloutSpec:
    """Check what staff sent (the API's JSON, the page's form): each refusal names its field."""
    if not isinstance(data, dict):
        raise _fail("body", "Expected an object.")
    allowed = {
        "name", "upgrade", "gpu_model", "region", "label", "batch_size", "max_region_share",
        "drain_deadline_s", "step_timeout_s",
    }  # fmt: skip
    unknown = sorted(str(k)[:40] for k in set(data) - allowed)
    if unknown:
        raise _fail(unknown[0], "Not a field of a rollout campaign.")
    name = data.get("name", "")
    if not isinstance(name, str) or not 1 <= len(name.strip()) <= 100 or "\x00" in name:
        raise _fail("name", "1 to 100 characters.")
    upgrade = data.get("upgrade")
    if not isinstance(upgrade, str) or not UPGRADE_NAME.match(upgrade):
        raise _fail(
            "upgrade",
            "The name of an upgrade configured on the agents: letters, digits and ._- (at most 64).",
        )
    gpu_model = region = None
    model_name = data.get("gpu_model") or ""
    if not isinstance(model_name, str):
        raise _fail("gpu_model", "A GPU model's name.")
    if model_name:
        gpu_model = GpuModel.objects.filter(Q(name=model_name) | Q(short_name=model_name)).first()
        if gpu_model is None:
            raise _fail("gpu_model", f"No GPU model {model_name[:80]!r} in the catalog.")
    region_code = data.get("region") or ""
    if not isinstance(region_code, str):
        raise _fail("region", "A region's code.")
    if region_code:
        region = Region.objects.filter(code=region_code).first()
        if region is None:
            raise _fail("region", f"No region {region_code[:40]!r}.")
    label = data.get("label") or ""
    if not isinstance(label, str):
        raise _fail("label", "key=value.")
    label_key = label_value = ""
    if label:
        label_key, sep, label_value = label.partition("=")
        label_key, label_value = label_key.strip(), label_value.strip()
        if not sep or not LABEL_KEY.match(label_key) or len(label_value) > 253 or "\x00" in label_value:
            raise _fail(
                "label", "key=value: a key of letters, digits and ._/- (at most 63), a value of at most 253."
            )
    return RolloutSpec(
        name=name.strip(),
        upgrade=upgrade,
        gpu_model=gpu_model,
        region=region,
        label_key=label_key,
        label_value=label_value,
        batch_size=_int(data, "batch_size", 1, MAX_BATCH_SIZE),
        max_region_share=_share(data.get("max_region_share")),
        drain_deadline_s=_int(data, "drain_deadline_s", 0, MAX_DRAIN_DEADLINE_S),
        step_timeout_s=_int(
            data, "step_timeout_s", MIN_STEP_TIMEOUT_S, MAX_STEP_TIMEOUT_S, default=DEFAULT_STEP_TIMEOUT_S
        ),
    )


def rollout_selected_nodes(*, spec: RolloutSpec) -> list[Node]:
    """The READY nodes the selector chooses that no open campaign holds, by region then hostname."""
    nodes = Node.objects.filter(state=NodeState.READY).select_related("region")
    if spec.region is not None:
        nodes = nodes.filter(region=spec.region)
    if spec.gpu_model is not None:
        nodes = nodes.filter(gpus__model=spec.gpu_model, gpus__removed_at__isnull=True)
    held = RolloutStep.objects.filter(
        campaign__state__in=OPEN_ROLLOUT_STATES,
        state__in=(RolloutStepState.PENDING, *ACTIVE_STEP_STATES, RolloutStepState.FAILED),
    ).values("node_id")
    chosen = nodes.exclude(pk__in=held).distinct().order_by("region__code", "hostname")
    if not spec.label_key:
        return list(chosen)
    # The label is matched here rather than in SQL: JSON containment is PostgreSQL's only (make run
    # uses SQLite), and a label key may hold characters a JSON key path would read as syntax.
    return [
        n for n in chosen if isinstance(n.labels, dict) and n.labels.get(spec.label_key) == spec.label_value
    ]


def _region_limit(share: Decimal, total: int) -> int:
    """How many of a region's ``total`` nodes may be out at once."""
    return int((share * total).to_integral_value(rounding=ROUND_FLOOR))


def rollout_start(*, data: Any, actor: Actor) -> RolloutCampaign:
    """Check the request, choose the nodes, make the campaign RUNNING with a step per node (audited).
    Its first batch drains at the next advance (on commit, and every beat)."""
    spec = rollout_spec_clean(data)
    if not (spec.gpu_model or spec.region or spec.label_key):
        raise ValidationFailed(
            "Choose the nodes: a gpu_model, a region or a label (any of them).",
            fields={"region": ["Give a GPU model, a region or a label to choose the nodes."]},
        )
    with transaction.atomic():
        nodes = rollout_selected_nodes(spec=spec)
        if not nodes:
            raise ValidationFailed(
                "No ready node matches, or every one is in another open campaign.",
                fields={"region": ["No ready node matches the selector outside other open campaigns."]},
            )
        totals = dict(
            Node.objects.filter(region_id__in={n.region_id for n in nodes})
            .values_list("region_id")
            .annotate(n=Count("id"))
        )
        for node in nodes:
            if _region_limit(spec.max_region_share, totals[node.region_id]) < 1:
                raise ValidationFailed(
                    f"max_region_share: {spec.max_region_share} of region {node.region.code}'s "
                    f"{totals[node.region_id]} nodes is less than one node.",
                    fields={"max_region_share": [f"Lets no node of {node.region.code} out at once."]},
                )
        now = timezone.now()
        campaign = RolloutCampaign.objects.create(
            name=spec.name,
            upgrade=spec.upgrade,
            gpu_model=spec.gpu_model,
            region=spec.region,
            label_key=spec.label_key,
            label_value=spec.label_value,
            batch_size=spec.batch_size,
            max_region_share=spec.max_region_share,
            drain_deadline_s=spec.drain_deadline_s,
            step_timeout_s=spec.step_timeout_s,
            created_by=actor.user,
            created_at=now,
            updated_at=now,
        )
        RolloutStep.objects.bulk_create(
            [RolloutStep(campaign=campaign, node=node, position=i) for i, node in enumerate(nodes)]
        )
        audit_record(
            tenant=None,
            actor=actor,
            action="rollout.start",
            target=campaign,
            data={
                "upgrade": spec.upgrade,
                "selector": rollout_selector_text(campaign),
                "nodes": [n.hostname for n in nodes],
                "batch_size": spec.batch_size,
                "max_region_share": str(spec.max_region_share),
                "drain_deadline_s": spec.drain_deadline_s,
                "step_timeout_s": spec.step_timeout_s,
            },
        )
        transaction.on_commit(_advance_soon)
    return campaign


def rollout_selector_text(campaign: RolloutCampaign) -> str:
    parts = []
    if campaign.gpu_model_id:
        parts.append(f"model {campaign.gpu_model}")
    if campaign.region_id:
        parts.append(f"region {campaign.region}")
    if campaign.label_key:
        parts.append(f"label {campaign.label_key}={campaign.label_value}")
    return ", ".join(parts)


def _advance_soon() -> None:
    """Ask a worker to advance the campaigns now rather than at the next beat."""
    if not settings.ROLLOUT_ADVANCE_ON_COMMIT:
        return
    from nodes.tasks import advance_rollouts

    try:
        advance_rollouts.apply_async(retry=False)
    except Exception:  # the broker is down: the beat entry advances them anyway
        logger.warning("Could not queue a rollout advance; the next beat run does it", exc_info=True)


# --- pause, resume, abort ---------------------------------------------------------------------------


def _staff_change(
    campaign: RolloutCampaign, *, allowed: tuple[str, ...], to: str, actor: Actor, action: str, reason: str
) -> RolloutCampaign:
    """Move a campaign from one of ``allowed`` to ``to`` under its lock, audited; 409 otherwise."""
    with transaction.atomic():
        campaign = lock_rollout(campaign_id=campaign.pk)
        if campaign.state not in allowed:
            raise Conflict(
                f"A {campaign.state} campaign cannot be {action}d.",
                code="invalid_state",
                fields={
                    "state": [f"{campaign.state}: only {', '.join(allowed)} campaigns can be {action}d."]
                },
            )
        old = campaign.state
        now = timezone.now()
        campaign.state = to
        campaign.updated_at = now
        if reason:
            campaign.state_reason = reason[:2000]
        fields = ["state", "updated_at", "state_reason"]
        if to == RolloutState.ABORTED:
            campaign.finished_at = now
            fields.append("finished_at")
            _stop_unstarted(campaign, now, why=f"Aborted by {actor}.")
        campaign.save(update_fields=fields)
        audit_record(
            tenant=None, actor=actor, action=f"rollout.{action}", target=campaign,
            data={"from": old, "to": to, "reason": reason},
        )  # fmt: skip
        transaction.on_commit(_advance_soon)
    return campaign


def rollout_pause(*, campaign: RolloutCampaign, actor: Actor, reason: str = "") -> RolloutCampaign:
    """No new batch starts; the nodes of the current one finish."""
    return _staff_change(
        campaign, allowed=(RolloutState.RUNNING,), to=RolloutState.PAUSED, actor=actor, action="pause",
        reason=reason,
    )  # fmt: skip


def rollout_resume(*, campaign: RolloutCampaign, actor: Actor, reason: str = "") -> RolloutCampaign:
    return _staff_change(
        campaign, allowed=(RolloutState.PAUSED,), to=RolloutState.RUNNING, actor=actor, action="resume",
        reason=reason,
    )  # fmt: skip


def rollout_abort(*, campaign: RolloutCampaign, actor: Actor, reason: str = "") -> RolloutCampaign:
    """Stop: pending nodes are cancelled, nodes only draining go back to service at once; a node whose
    upgrade or check has started finishes it (then returns, or fails and stays drained)."""
    return _staff_change(
        campaign, allowed=OPEN_ROLLOUT_STATES, to=RolloutState.ABORTED, actor=actor, action="abort",
        reason=reason or f"Aborted by {actor}.",
    )  # fmt: skip


def _stop_unstarted(campaign: RolloutCampaign, now: datetime, *, why: str) -> None:
    """The campaign stops (aborted or failed): pending steps are cancelled and draining nodes return."""
    unstarted = (RolloutStepState.PENDING, RolloutStepState.DRAINING)
    for step in lock_rollout_steps(campaign_id=campaign.pk, states=unstarted):
        if step.state == RolloutStepState.DRAINING:
            _return_node(step, campaign, now, why=why)
        step.state = RolloutStepState.CANCELLED
        step.message = why[:2000]
        step.finished_at = now
        step.save(update_fields=["state", "message", "finished_at"])


# --- node state changes the campaign makes (audited, as the system) ----------------------------------


def _set_node_state(node: Node, state: str, reason: str, campaign: RolloutCampaign, now: datetime) -> Node:
    """Move a locked node to ``state`` for the campaign, audited as the system's doing."""
    old = node.state
    node.state = state
    node.state_reason = reason[:255]
    node.state_changed_at = now
    node.resume_state = ""
    node.save(update_fields=["state", "state_reason", "state_changed_at", "resume_state"])
    audit_record(
        tenant=None,
        actor=Actor.system(),
        action="node.rollout_drain" if state == NodeState.DRAINING else "node.rollout_return",
        target=node,
        data={"from": old, "to": state, "campaign": campaign.pk, "reason": reason},
    )
    return node


def _return_node(step: RolloutStep, campaign: RolloutCampaign, now: datetime, *, why: str) -> None:
    """The node back to READY and its agent told to take work again (``undrain``). A node staff
    moved meanwhile (cordoned, maintenance, back to ready) is theirs and left as it is; a silent
    one returns READY when its heartbeats resume."""
    node = lock_node(node_id=step.node_id)
    if node.state == NodeState.DRAINING:
        _set_node_state(node, NodeState.READY, f"Rollout {campaign.pk}: {why}", campaign, now)
        send_on_commit(node_ready, sender=Node, node=node)
    elif node.state in (NodeState.SUSPECT, NodeState.DOWN) and node.resume_state == NodeState.DRAINING:
        Node.objects.filter(pk=node.pk).update(resume_state="")
    else:
        return
    node_command_enqueue(node=node, kind=CommandKind.UNDRAIN, payload={}, now=now)


# --- advance (beat) ---------------------------------------------------------------------------------


def _try_advance_lock() -> bool:
    """The advance step's single-flight lock, for this session (released in ``rollout_advance``).
    SQLite serialises writers already (BEGIN IMMEDIATE), so there it is always granted."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(%s)", [ADVANCE_LOCK_KEY])
        return bool(cur.fetchone()[0])


def _release_advance_lock() -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s)", [ADVANCE_LOCK_KEY])


def rollout_advance(*, now: datetime | None = None) -> dict[str, int]:
    """Move every open campaign on by what has happened since the last run. Safe to run twice and
    at once from two workers (one runs, the other returns at once); each campaign's step is its own
    transaction. Returns counts of what it did."""
    done = {"campaigns": 0, "skipped": 0}
    if not _try_advance_lock():
        done["skipped"] = 1
        return done
    try:
        ids = list(
            RolloutCampaign.objects.filter(
                Q(state__in=OPEN_ROLLOUT_STATES) | Q(steps__state__in=ACTIVE_STEP_STATES)
            )
            .distinct()
            .order_by("created_at", "id")
            .values_list("pk", flat=True)
        )
        for campaign_id in ids:
            try:
                _advance_campaign(campaign_id, now or timezone.now())
                done["campaigns"] += 1
            except Exception:
                logger.exception("Rollout %s could not advance; the next run tries again", campaign_id)
    finally:
        _release_advance_lock()
    return done


def _advance_campaign(campaign_id: int, now: datetime) -> None:
    with transaction.atomic():
        campaign = lock_rollout(campaign_id=campaign_id)
        active = lock_rollout_steps(campaign_id=campaign.pk, states=ACTIVE_STEP_STATES)
        work = _node_work([s.node_id for s in active if s.state == RolloutStepState.DRAINING])
        for step in active:
            _advance_step(campaign, step, work.get(step.node_id, 0), now)
            if step.state == RolloutStepState.FAILED and campaign.is_open:
                _campaign_failed(campaign, step, now)
        if campaign.state == RolloutState.RUNNING and not any(s.state in ACTIVE_STEP_STATES for s in active):
            _next_batch(campaign, now)
    # Notice to the work of draining nodes goes after the commit (scheduling locks its own rows);
    # the step records it only once given, so a failure here is tried again by the next run.
    for step in RolloutStep.objects.filter(campaign_id=campaign_id, state=RolloutStepState.DRAINING).filter(
        Q(notice_given_at__isnull=True) | Q(drain_deadline_at__lte=now, deadline_notice_at__isnull=True)
    ):
        final = step.drain_deadline_at <= now
        _give_notice(step.node_id, step.drain_deadline_at, final=final, reason="node_upgrade")
        stamp = {"notice_given_at": step.notice_given_at or now}
        if final:
            stamp["deadline_notice_at"] = now
        RolloutStep.objects.filter(pk=step.pk).update(**stamp)


def _campaign_failed(campaign: RolloutCampaign, step: RolloutStep, now: datetime) -> None:
    hostname = Node.objects.filter(pk=step.node_id).values_list("hostname", flat=True).first()
    reason = f"{hostname}: {step.message}"
    campaign.state = RolloutState.FAILED
    campaign.state_reason = reason[:2000]
    campaign.finished_at = campaign.updated_at = now
    campaign.save(update_fields=["state", "state_reason", "finished_at", "updated_at"])
    _stop_unstarted(campaign, now, why=f"The campaign stopped: {reason}")
    audit_record(
        tenant=None, actor=Actor.system(), action="rollout.fail", target=campaign,
        data={"node": hostname, "reason": step.message},
    )  # fmt: skip
    logger.warning("Rollout %s failed on %s: %s", campaign.pk, hostname, step.message)


def _fail_step(step: RolloutStep, message: str, now: datetime) -> None:
    step.state = RolloutStepState.FAILED
    step.message = message[:2000]
    step.finished_at = now
    step.save(update_fields=["state", "message", "finished_at"])
    Node.objects.filter(pk=step.node_id, state=NodeState.DRAINING).update(
        state_reason=f"Rollout {step.campaign_id} failed here: {message}"[:255]
    )


def _command(step: RolloutStep, kind: str, payload: dict[str, Any], now: datetime, timeout_s: int) -> None:
    """Send the step's next command; it must be taken within the step timeout."""
    command = node_command_enqueue(
        node=Node(pk=step.node_id),
        kind=kind,
        payload=payload,
        deadline=now + timedelta(seconds=timeout_s),
        idempotency_key=f"rollout:{step.campaign_id}:{step.pk}:{kind}",
        now=now,
    )
    step.command = command
    step.command_started_at = now


def _command_outcome(step: RolloutStep, what: str, timeout_s: int, now: datetime) -> str | None:
    """``succeeded``, a failure message, or None while the command is still on its way."""
    command = NodeCommand.objects.filter(pk=step.command_id).first() if step.command_id else None
    if command is None:
        return f"the {what} command is gone"
    if command.state == CommandState.SUCCEEDED:
        return "succeeded"
    if command.state == CommandState.FAILED:
        return f"{what} failed: {command.message or command.result.get('reason') or 'no reason given'}"
    if command.state == CommandState.EXPIRED:
        return f"{what} was not taken by the agent ({command.result.get('reason', 'expired')})"
    if step.command_started_at and now >= step.command_started_at + timedelta(seconds=timeout_s):
        return f"{what} gave no result within {timeout_s} s"
    return None


def _advance_step(campaign: RolloutCampaign, step: RolloutStep, work: int, now: datetime) -> None:
    if step.state == RolloutStepState.DRAINING:
        if work == 0:
            step.state = RolloutStepState.UPGRADING
            step.message = f"Upgrading ({campaign.upgrade})."
            _command(step, CommandKind.UPGRADE,
                     {"upgrade": campaign.upgrade, "timeout_s": campaign.step_timeout_s}, now,
                     campaign.step_timeout_s)  # fmt: skip
            step.save(update_fields=["state", "message", "command", "command_started_at"])
        elif now >= step.drain_deadline_at + timedelta(seconds=settings.ROLLOUT_DRAIN_GRACE_S):
            _fail_step(
                step, f"{work} workload(s) still on the node after the drain deadline and its grace", now
            )
        else:
            step.message = f"Draining: {work} workload(s) left."
            step.save(update_fields=["message"])
        return
    what = "upgrade" if step.state == RolloutStepState.UPGRADING else "GPU check"
    outcome = _command_outcome(step, what, campaign.step_timeout_s, now)
    if outcome is None:
        return
    if outcome != "succeeded":
        _fail_step(step, outcome, now)
        return
    if step.state == RolloutStepState.UPGRADING:
        step.state = RolloutStepState.CHECKING
        step.message = "Checking the GPUs."
        _command(step, CommandKind.GPU_CHECK, {}, now, campaign.step_timeout_s)
        step.save(update_fields=["state", "message", "command", "command_started_at"])
        return
    result = NodeCommand.objects.get(pk=step.command_id).result or {}
    _return_node(step, campaign, now, why=f"upgraded ({campaign.upgrade}) and checked")
    step.state = RolloutStepState.RETURNED
    step.message = f"Upgraded; GPU check passed ({result.get('gpus', '?')} GPU(s))."
    step.finished_at = now
    step.save(update_fields=["state", "message", "finished_at"])


def _next_batch(campaign: RolloutCampaign, now: datetime) -> None:
    """Drain the next batch within each region's share; complete the campaign when none is left."""
    pending = lock_rollout_steps(campaign_id=campaign.pk, states=(RolloutStepState.PENDING,))
    if not pending:
        failed = campaign.steps.filter(state=RolloutStepState.FAILED).exists()
        campaign.state = RolloutState.FAILED if failed else RolloutState.COMPLETED
        campaign.finished_at = campaign.updated_at = now
        campaign.save(update_fields=["state", "finished_at", "updated_at"])
        audit_record(tenant=None, actor=Actor.system(), action=f"rollout.{campaign.state}", target=campaign)
        return
    nodes = Node.objects.in_bulk([s.node_id for s in pending])
    regions = {n.region_id for n in nodes.values()}
    totals = dict(Node.objects.filter(region_id__in=regions).values_list("region_id").annotate(n=Count("id")))
    out = dict(
        Node.objects.filter(region_id__in=regions)
        .exclude(state=NodeState.READY)
        .values_list("region_id")
        .annotate(n=Count("id"))
    )
    chosen: list[RolloutStep] = []
    waiting: list[str] = []
    for step in pending:
        if len(chosen) >= campaign.batch_size:
            break
        node = nodes[step.node_id]
        region = node.region_id
        limit = _region_limit(campaign.max_region_share, totals.get(region, 0))
        if node.state != NodeState.READY:
            continue  # out for another reason now: it waits until it is back
        if out.get(region, 0) + 1 > limit:
            code = Region.objects.filter(pk=region).values_list("code", flat=True).first()
            waiting.append(f"region {code} has {out.get(region, 0)} of {totals[region]} nodes out")
            continue
        out[region] = out.get(region, 0) + 1
        chosen.append(step)
    if not chosen:
        note = "Waiting: " + ("; ".join(sorted(set(waiting))) or "the remaining nodes are not ready") + "."
        if campaign.state_reason != note:
            campaign.state_reason = note
            campaign.save(update_fields=["state_reason"])
        return
    campaign.batches_started += 1
    campaign.state_reason = ""
    campaign.updated_at = now
    campaign.save(update_fields=["batches_started", "state_reason", "updated_at"])
    deadline = now + timedelta(seconds=campaign.drain_deadline_s)
    for step in chosen:
        node = lock_node(node_id=step.node_id)
        if node.state != NodeState.READY:
            continue  # changed since it was read: the next batch takes it
        _set_node_state(node, NodeState.DRAINING, f"Rollout {campaign.pk}: {campaign.name}", campaign, now)
        node_command_enqueue(
            node=node, kind=CommandKind.DRAIN, payload={}, idempotency_key=f"rollout:{campaign.pk}:{step.pk}:drain",
            now=now,
        )  # fmt: skip
        step.state = RolloutStepState.DRAINING
        step.batch = campaign.batches_started
        step.drain_started_at = now
        step.drain_deadline_at = deadline
        step.message = "Draining."
        step.save(update_fields=["state", "batch", "drain_started_at", "drain_deadline_at", "message"])
