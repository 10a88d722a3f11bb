"""Workloads (instances and jobs), their events, GPU allocations, quotas, reservations and warm pools.

Capacity is counted in thousandths of a GPU ("milli"): a whole GPU is 1000.

Double allocation is impossible by construction in the database, not only by the scheduler's care:
every active Allocation holds the half-open range ``[milli_offset, milli_offset + fraction_milli)``
of its GPU's 0..1000 capacity, and active ranges on one GPU may not overlap. A whole GPU is
``[0, 1000)`` and so conflicts with anything else on that GPU; shared fractions are disjoint ranges,
so their sum can never pass 1000. On PostgreSQL this is an exclusion constraint
(``EXCLUDE USING gist (gpu_id WITH =, int4range(...) WITH &&) WHERE (ended_at IS NULL)``); on SQLite
the same rule is a pair of triggers that abort the insert or update (SQLite also serialises writers,
so the check cannot race). Both are created by migration ``0002_allocation_no_overlap``. The offsets
are bookkeeping only: the scheduler packs them (``scheduling.services.allocations``) and nothing
outside this app reads them.

Over-subscription (``GpuModel.oversubscription``, factor f >= 1): a fractional, non-MIG share of
``fraction_milli`` on such a GPU holds only ``span_milli = ceil(fraction_milli / f)`` of the 0..1000
range, so shares may add up to f GPUs while the ranges still may not overlap. ``fraction_milli``
stays what the tenant asked for (metering bills it); ``span_milli`` is null where it equals it, and
a whole GPU (``fraction_milli`` 1000) always spans all of it (migration ``0005_allocation_span``).
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.tenancy import PersonOwnedModel, TenantOwnedModel, TenantQuerySet

MILLI = 1000
# Allocations of Slurm jobs closed by gpupool before sacct had their end: another job took their
# GPUs (its end comes from sacct later: billed then), or Slurm requeued the job (billed to then).
SLURM_RELEASED = "slurm_released"
SLURM_REQUEUED = "slurm_requeued"
MAX_GPUS_PER_NODE = 8


class WorkloadKind(models.TextChoices):
    INSTANCE = "instance", "Instance"
    JOB = "job", "Job"


class WorkloadState(models.TextChoices):
    PENDING = "pending", "Pending"
    QUEUED = "queued", "Queued"
    SCHEDULED = "scheduled", "Scheduled"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    STOPPING = "stopping", "Stopping"
    PREEMPTED = "preempted", "Preempted"
    STOPPED = "stopped", "Stopped"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


TERMINAL_STATES = frozenset({WorkloadState.STOPPED, WorkloadState.SUCCEEDED, WorkloadState.FAILED})
WAITING_STATES = frozenset({WorkloadState.PENDING, WorkloadState.QUEUED})
# States in which a workload holds its allocation.
HOLDING_STATES = frozenset(
    {
        WorkloadState.SCHEDULED,
        WorkloadState.STARTING,
        WorkloadState.RUNNING,
        WorkloadState.STOPPING,
        WorkloadState.PREEMPTED,
    }
)
ACTIVE_STATES = WAITING_STATES | HOLDING_STATES


class Plan(models.TextChoices):
    ON_DEMAND = "on_demand", "On demand"
    SPOT = "spot", "Spot"
    RESERVED = "reserved", "Reserved"


class PriorityClass(models.TextChoices):
    """Higher runs first and may preempt lower. Empty on a workload: its plan's class."""

    RESERVED = "reserved", "Reserved"
    ON_DEMAND = "on_demand", "On demand"
    SPOT = "spot", "Spot"
    WARM_POOL = "warm_pool", "Warm pool"


class GpuVendor(models.TextChoices):
    NVIDIA = "nvidia", "NVIDIA"
    AMD = "amd", "AMD"
    INTEL = "intel", "Intel"


class Workload(TenantOwnedModel):
    """An instance (long-running, interactive) or a job (batch, runs to completion)."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="workloads")
    kind = models.CharField(max_length=16, choices=WorkloadKind.choices)
    name = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=16, choices=WorkloadState.choices, default=WorkloadState.PENDING)
    state_reason = models.CharField(max_length=255, blank=True)

    # GPUs: explicit models (any of them), and/or constraints; no model and no constraint = any GPU.
    gpu_models = models.ManyToManyField("nodes.GpuModel", blank=True, related_name="+")
    min_gpu_memory_gib = models.PositiveIntegerField(default=0)
    min_compute_weight = models.DecimalField(max_digits=5, decimal_places=2, default=0)
    gpu_vendor = models.CharField(max_length=16, choices=GpuVendor.choices, blank=True)
    cuda_capability = models.CharField(max_length=8, blank=True, help_text="Minimum, e.g. 8.0")
    rocm_target = models.CharField(max_length=16, blank=True, help_text="Exact gfx target, e.g. gfx942")
    # Minimum versions of the node's software stack (release versions, e.g. "12.4"); blank: any.
    min_driver = models.CharField(max_length=32, blank=True, help_text="Minimum GPU driver, e.g. 550.54")
    min_cuda = models.CharField(max_length=32, blank=True, help_text="Minimum CUDA (driver API), e.g. 12.4")
    min_rocm = models.CharField(max_length=32, blank=True, help_text="Minimum ROCm, e.g. 6.1")
    gpu_count = models.PositiveSmallIntegerField(default=1)
    gang = models.BooleanField(default=False, help_text="All-or-nothing across whole nodes.")
    gpus_per_node = models.JSONField(
        default=list,
        blank=True,
        help_text="Piece sizes its GPUs may be split into over several nodes; empty: one node.",
    )
    split_regions_ok = models.BooleanField(default=False, help_text="Its pieces may be in several regions.")
    gang_port = models.PositiveIntegerField(
        null=True, blank=True, help_text="MASTER_PORT of its placement across nodes (rank 0 listens)."
    )
    gpu_fraction_milli = models.PositiveSmallIntegerField(default=MILLI)
    # Elastic jobs (scheduling.engine.elastic): ``gpu_count`` is what it holds now (or starts with),
    # between these bounds; the scheduler grows it up to ``elastic_target_gpus`` (the tenant's
    # wish, the maximum unless resized) and shrinks it toward the minimum before preempting others.
    elastic_min_gpus = models.PositiveSmallIntegerField(null=True, blank=True)
    elastic_max_gpus = models.PositiveSmallIntegerField(null=True, blank=True)
    elastic_target_gpus = models.PositiveSmallIntegerField(null=True, blank=True)
    elastic_on_resize = models.CharField(
        max_length=8,
        choices=[("signal", "Signal"), ("restart", "Restart")],
        blank=True,
        help_text="How a resize reaches it: a file and SIGUSR1, or a restart from its checkpoint.",
    )
    mig_profile = models.CharField(max_length=32, blank=True)
    cpu_millicores = models.PositiveIntegerField(default=0, help_text="Per node.")
    ram_mib = models.PositiveBigIntegerField(default=0, help_text="Per node.")
    region = models.ForeignKey(
        "nodes.Region", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    other_regions_ok = models.BooleanField(default=True)
    plan = models.CharField(max_length=16, choices=Plan.choices, default=Plan.ON_DEMAND)
    spot_max_price = models.DecimalField(max_digits=22, decimal_places=10, null=True, blank=True)
    reservation = models.ForeignKey(
        "scheduling.Reservation", null=True, blank=True, on_delete=models.PROTECT, related_name="workloads"
    )
    priority_class = models.CharField(max_length=16, choices=PriorityClass.choices, blank=True)

    # What runs. Instances: image or template, ports, SSH key, optional maximum runtime.
    # Jobs: image and command, estimated runtime, requeue on preemption (resuming from the
    # checkpoint the job writes), maximum retries.
    image = models.CharField(max_length=255, blank=True)
    template = models.CharField(max_length=100, blank=True)
    command = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)
    ports = models.JSONField(default=list, blank=True)
    ssh_public_key = models.TextField(blank=True)
    max_runtime_s = models.PositiveIntegerField(null=True, blank=True)
    estimated_runtime_s = models.PositiveIntegerField(null=True, blank=True)
    requeue_on_preemption = models.BooleanField(default=True)
    checkpoint_resume = models.BooleanField(default=False)
    max_retries = models.PositiveSmallIntegerField(default=0)
    retries = models.PositiveSmallIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=0, help_text="Placements so far; part of command ids.")
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    # Set on a victim while it is being preempted: the workload it makes room for.
    preempted_for = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    avoid_nodes = models.JSONField(
        default=list,
        blank=True,
        help_text="Ids of nodes that failed to start it (start failed or timed out); placed elsewhere "
        "unless no other node could ever take it.",
    )

    # Placement constraints (scheduling.engine.constraints), validated by services.placement.
    node_selector = models.JSONField(default=dict, blank=True, help_text="Node labels it needs.")
    affinity = models.JSONField(default=dict, blank=True, help_text="Near its own workloads.")
    anti_affinity = models.JSONField(default=dict, blank=True, help_text="Away from its own workloads.")
    spread = models.JSONField(default=dict, blank=True, help_text="Members over a label's values.")
    preference = models.CharField(max_length=16, blank=True, help_text="fastest or cheapest")

    # Job arrays (scheduling.services.arrays): the array job keeps the spec, the counts and, in
    # work-queue mode, the items' lease; it never holds GPUs. Its tasks are jobs of their own
    # (state, retries, logs, usage) pointing at it by ``array_parent`` and ``array_index``.
    array_count = models.PositiveIntegerField(null=True, blank=True, help_text="Array job: its tasks.")
    array_parallelism = models.PositiveIntegerField(null=True, blank=True)
    work_lease_s = models.PositiveIntegerField(null=True, blank=True, help_text="Work-queue mode.")
    array_parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="array_tasks"
    )
    array_index = models.PositiveIntegerField(null=True, blank=True)
    # An array job of a Slurm region: each task's workload id by index, reserved before its one
    # Slurm array job is submitted (the batch script tells each task its own id; task rows are made
    # with these ids as the cycle makes them).
    array_task_ids = models.JSONField(null=True, blank=True)

    # Why it waits, as the scheduler last saw it.
    pending_reason = models.CharField(max_length=32, blank=True)
    pending_message = models.CharField(max_length=255, blank=True)
    expected_start_at = models.DateTimeField(null=True, blank=True)

    exit_code = models.IntegerField(null=True, blank=True)
    log_tail = models.TextField(blank=True, help_text="The last message the agent reported.")
    submitted_at = models.DateTimeField(default=timezone.now)
    queued_at = models.DateTimeField(null=True, blank=True)
    scheduled_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["state", "submitted_at"], name="workload_state_submitted"),
            models.Index(fields=["tenant", "state"], name="workload_tenant_state"),
            # The cycle's look for unfinished array jobs (few rows among many running workloads).
            models.Index(
                fields=["state"], name="workload_array_state", condition=Q(array_count__isnull=False)
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(gpu_fraction_milli__gte=1, gpu_fraction_milli__lte=MILLI),
                name="workload_fraction_range",
            ),
            models.CheckConstraint(
                condition=Q(gpu_fraction_milli=MILLI) | Q(gpu_count=1), name="workload_fraction_one_gpu"
            ),
            models.CheckConstraint(condition=Q(gpu_count__gte=1), name="workload_gpu_count_positive"),
            models.CheckConstraint(
                condition=~Q(plan="reserved") | Q(reservation__isnull=False),
                name="workload_reserved_has_reservation",
            ),
            models.UniqueConstraint(
                fields=["array_parent", "array_index"],
                condition=Q(array_parent__isnull=False),
                name="workload_array_task_unique",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.pk}{f' ({self.name})' if self.name else ''}"

    @property
    def gpu_milli(self) -> int:
        """GPU capacity this workload asks for, in thousandths of a GPU."""
        return self.gpu_count * self.gpu_fraction_milli

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def is_elastic(self) -> bool:
        return self.elastic_min_gpus is not None

    @property
    def is_array(self) -> bool:
        """An array job: its tasks run, it does not."""
        return self.array_count is not None


class WorkloadEvent(TenantOwnedModel):
    """One state transition (or a notable step) of a workload, with its reason."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    from_state = models.CharField(max_length=16, choices=WorkloadState.choices, blank=True)
    to_state = models.CharField(max_length=16, choices=WorkloadState.choices)
    reason = models.CharField(max_length=64)
    message = models.CharField(max_length=500, blank=True)
    actor_repr = models.CharField(max_length=200, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["workload", "at"], name="workloadevent_workload_at")]

    def __str__(self) -> str:
        return f"{self.workload_id}: {self.from_state or '-'} -> {self.to_state} ({self.reason})"


class PublishedPort(models.Model):
    """A port of a running workload as its node published it (the start command's result): kept
    while the workload holds its GPUs, deleted when it stops holding them. ``host_port`` is null
    for a port the node did not publish (the simulated runtime publishes none); ``note`` says why."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="published_ports")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="+")
    port = models.PositiveIntegerField()
    protocol = models.CharField(max_length=8)
    host_port = models.PositiveIntegerField(null=True, blank=True)
    note = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["workload", "port"]
        constraints = [
            models.UniqueConstraint(fields=["workload", "node", "port"], name="publishedport_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.workload_id}:{self.port}/{self.protocol} -> {self.host_port}"


class GangAddress(models.Model):
    """A gang member's own address on its region's gang network (``Region.gang_subnet``), handed
    out by the cycle at placement (for that ``attempt``) and deleted once the member is gone: the
    gang stopped holding its GPUs (or was placed again) and no stop of it on that node awaits the
    node's word (``scheduling.services.gangs.gang_addresses_release``). Unique per region: two
    members never share one, whichever portal process placed them."""

    region = models.ForeignKey("nodes.Region", on_delete=models.CASCADE, related_name="+")
    address = models.GenericIPAddressField(protocol="IPv4")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="gang_addresses")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="+")
    rank = models.PositiveIntegerField()
    attempt = models.PositiveIntegerField()

    class Meta:
        ordering = ["workload", "attempt", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["region", "address"], name="gangaddress_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.workload_id} rank {self.rank}: {self.address}"


class WorkloadShareLink(TenantOwnedModel):
    """The share link of a workload's HTTP ports: anyone holding its secret may use them through the
    portal's proxy while the workload runs. One per workload; revoking deletes it. Only the secret's
    SHA-256 is kept (the link is shown once)."""

    PREFIX = "gpl"

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.OneToOneField(Workload, on_delete=models.CASCADE, related_name="share_link")
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"share link of {self.workload_id}"


class AllocationQuerySet(TenantQuerySet):
    def active(self):
        return self.filter(ended_at__isnull=True)


class Allocation(TenantOwnedModel):
    """A share of one GPU held by a workload from ``started_at`` to ``ended_at`` (open while held).

    ``tenant``, ``gpu_model`` and ``plan`` are copied from the workload and GPU when the row is made,
    so metering bills intervals without re-reading specs that may change later.
    """

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="+")
    gpu = models.ForeignKey("nodes.Gpu", on_delete=models.PROTECT, related_name="+")
    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.PROTECT, related_name="+")
    plan = models.CharField(max_length=16, choices=Plan.choices)
    fraction_milli = models.PositiveSmallIntegerField(default=MILLI)
    span_milli = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="Capacity of the GPU held, when less than the fraction (an over-subscribed GPU).",
    )
    milli_offset = models.PositiveSmallIntegerField(default=0)
    resized = models.BooleanField(
        default=False, help_text="Given to a running elastic job by a resize: billed from its start."
    )
    mig_start = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="A MIG instance: the memory slice it starts at on the GPU (the agent makes it there).",
    )
    started_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=64, blank=True)
    # Released without the node's word (stop timeout, forced preemption, node DOWN): the node may
    # still run it, so its GPU takes no new work until the node reports it gone (confirmed).
    stop_forced_at = models.DateTimeField(null=True, blank=True)
    stop_confirmed_at = models.DateTimeField(null=True, blank=True)
    # A Slurm region's: the Slurm job (an array task: ``<id>_<index>``) that held the GPU. Its
    # interval is Slurm's (start, and sacct's end), billed as it is (``metering.services.usage``).
    slurm_job_label = models.CharField(max_length=32, blank=True)

    objects = AllocationQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(fraction_milli__gte=1, fraction_milli__lte=MILLI),
                name="allocation_fraction_range",
            ),
            models.CheckConstraint(
                condition=Q(milli_offset__gte=0)
                & Q(milli_offset__lte=MILLI - Coalesce(F("span_milli"), F("fraction_milli"))),
                name="allocation_range_inside_gpu",
            ),
            # An over-subscribed share holds less than its fraction, at least 1; a whole GPU all of it.
            models.CheckConstraint(
                condition=Q(span_milli__isnull=True)
                | Q(span_milli__gte=1, span_milli__lte=F("fraction_milli"), fraction_milli__lt=MILLI),
                name="allocation_span_range",
            ),
            models.CheckConstraint(
                condition=Q(ended_at__isnull=True) | Q(ended_at__gte=F("started_at")),
                name="allocation_ends_after_start",
            ),
            # A workload holds a GPU at most once at a time.
            models.UniqueConstraint(
                fields=["workload", "gpu"],
                condition=Q(ended_at__isnull=True),
                name="allocation_one_per_workload_gpu",
            ),
        ]
        indexes = [
            models.Index(fields=["gpu"], condition=Q(ended_at__isnull=True), name="allocation_active_gpu"),
            models.Index(fields=["tenant", "started_at"], name="allocation_tenant_started"),
            models.Index(fields=["ended_at"], name="allocation_ended"),
            models.Index(
                fields=["node", "gpu"],
                condition=Q(stop_forced_at__isnull=False, stop_confirmed_at__isnull=True),
                name="allocation_stop_unconfirmed",
            ),
        ]

    def __str__(self) -> str:
        return f"workload {self.workload_id} on gpu {self.gpu_id} ({self.fraction_milli}/1000)"

    @property
    def stop_unconfirmed(self) -> bool:
        return self.stop_forced_at is not None and self.stop_confirmed_at is None

    @property
    def span(self) -> int:
        """The capacity of its GPU this row holds (thousandths)."""
        return self.span_milli if self.span_milli is not None else self.fraction_milli


class Quota(TenantOwnedModel):
    """A tenant's limits, set by staff. Empty (null) means no limit. One row per tenant; it is also
    the row that submissions lock (``scheduling.locks.lock_quota``) so that concurrent submissions
    of one tenant are admitted one at a time."""

    tenant = models.OneToOneField("portal.Tenant", on_delete=models.CASCADE, related_name="quota")
    max_gpus_total = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_workloads = models.PositiveIntegerField(null=True, blank=True)
    max_spot_gpus = models.PositiveIntegerField(null=True, blank=True)
    max_gpus_per_request = models.PositiveIntegerField(null=True, blank=True)
    fair_share_weight = models.DecimalField(
        max_digits=6,
        decimal_places=2,
        default=1,
        validators=[MinValueValidator(Decimal("0.01"))],
        help_text="Weight in fair sharing between tenants of one priority class (default 1).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant_id"]

    def __str__(self) -> str:
        return f"quota of tenant {self.tenant_id}"


class QuotaModelLimit(models.Model):
    """The most GPUs of one model a tenant may hold (counting waiting single-model requests)."""

    quota = models.ForeignKey(Quota, on_delete=models.CASCADE, related_name="model_limits")
    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.CASCADE, related_name="+")
    max_gpus = models.PositiveIntegerField()

    class Meta:
        ordering = ["quota_id", "gpu_model_id"]
        constraints = [models.UniqueConstraint(fields=["quota", "gpu_model"], name="quotamodellimit_unique")]

    def __str__(self) -> str:
        return f"{self.gpu_model_id}: {self.max_gpus}"


class ReservationStatus(models.TextChoices):
    REQUESTED = "requested", "Requested"
    ACTIVE = "active", "Active"
    CANCELLED = "cancelled", "Cancelled"


class Reservation(TenantOwnedModel):
    """Capacity guaranteed to a tenant: ``count`` GPUs of ``gpu_model`` in ``region`` during the
    half-open period ``[starts_at, ends_at)``. Active reservations are what metering bills; while
    idle, the capacity may be lent to preemptible (spot, warm-pool) work of others."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="reservations")
    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.PROTECT, related_name="+")
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+")
    count = models.PositiveIntegerField()
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    status = models.CharField(
        max_length=16, choices=ReservationStatus.choices, default=ReservationStatus.REQUESTED
    )
    note = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    activated_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When staff confirmed it; a reservation never confirmed is never billed.",
    )
    cancelled_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it was cancelled: it is billed up to here (or its end, if earlier).",
    )
    cancel_fee_percent = models.DecimalField(
        max_digits=6,
        decimal_places=3,
        default=0,
        help_text="Set at cancellation (RESERVATION_CANCEL_FEE_PERCENT): the fee, a percent of what the "
        "rest of the term would have cost.",
    )

    class Meta:
        ordering = ["-starts_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(ends_at__gt=F("starts_at")), name="reservation_period_positive"
            ),
            models.CheckConstraint(condition=Q(count__gte=1), name="reservation_count_positive"),
        ]
        indexes = [models.Index(fields=["status", "starts_at", "ends_at"], name="reservation_status_period")]

    def __str__(self) -> str:
        return f"{self.count}x {self.gpu_model_id} in {self.region_id} for tenant {self.tenant_id}"

    def is_in_force(self, at) -> bool:
        return self.status == ReservationStatus.ACTIVE and self.starts_at <= at < self.ends_at

    @property
    def billed_until(self):
        """The end of what it is billed for: its term's end, or its cancellation if that came first."""
        if self.cancelled_at is not None and self.cancelled_at < self.ends_at:
            return max(self.cancelled_at, self.starts_at)
        return self.ends_at


class WarmPool(models.Model):
    """Staff-defined pool of prewarmed GPUs per (model, image or template, region).

    ``target_size`` is what the scheduler keeps warm: at least ``min_size``, grown from recent
    demand (an exponentially weighted arrival rate times the cold-start time) and shrunk when it
    falls, never above ``max_size``."""

    gpu_model = models.ForeignKey("nodes.GpuModel", on_delete=models.CASCADE, related_name="+")
    region = models.ForeignKey("nodes.Region", on_delete=models.CASCADE, related_name="+")
    image = models.CharField(max_length=255, blank=True)
    template = models.CharField(max_length=100, blank=True)
    min_size = models.PositiveIntegerField(default=0)
    max_size = models.PositiveIntegerField(default=8)
    target_size = models.PositiveIntegerField(default=0)
    cold_start_s = models.PositiveIntegerField(default=120)
    arrival_rate_per_s = models.FloatField(
        default=0.0, help_text="Exponentially weighted arrivals per second."
    )
    rate_updated_at = models.DateTimeField(null=True, blank=True)
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["gpu_model_id", "region_id", "image", "template"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu_model", "region", "image", "template"], name="warmpool_unique"
            ),
            models.CheckConstraint(condition=~Q(image="", template=""), name="warmpool_image_or_template"),
            models.CheckConstraint(condition=Q(max_size__gte=F("min_size")), name="warmpool_max_ge_min"),
        ]

    def __str__(self) -> str:
        return f"warm pool {self.gpu_model_id}/{self.region_id}/{self.image or self.template}"


class WarmSlot(models.Model):
    """One GPU prewarmed for a pool (its image pulled, through a ``prewarm`` command). A slot holds
    no allocation: real demand takes the GPU whenever it needs it (the slot then ends), and a
    request that matches the pool binds to a free slot before the engine places the rest, to a ready
    one (its prewarm finished: ``ready_at``) before one still prewarming. A failed prewarm ends the
    slot (``prewarm_failed``) and the pool's reconciler prewarms another GPU."""

    pool = models.ForeignKey(WarmPool, on_delete=models.CASCADE, related_name="slots")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="+")
    gpu = models.ForeignKey("nodes.Gpu", on_delete=models.CASCADE, related_name="+")
    command_id = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(
        null=True, blank=True, help_text="When the prewarm command finished; empty while it runs."
    )
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=32, blank=True)
    bound_to = models.ForeignKey(Workload, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["pool_id", "node_id", "gpu_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu"], condition=Q(ended_at__isnull=True), name="warmslot_one_per_gpu"
            ),
        ]

    def __str__(self) -> str:
        return f"warm slot of pool {self.pool_id} on gpu {self.gpu_id}"


class WorkloadTemplateQuerySet(TenantQuerySet):
    def catalog(self):
        """The templates staff manage, offered to every tenant."""
        return self.filter(tenant__isnull=True)

    def available_to(self, tenant):
        """What a tenant may launch from: the catalog and its own."""
        if tenant is None:
            return self.catalog()
        return self.filter(Q(tenant__isnull=True) | Q(tenant=tenant))


class WorkloadTemplate(TenantOwnedModel):
    """What to run, ready to launch: the catalog's (``tenant`` empty, managed by staff) or a
    tenant's own. Launching by template fills the request's spec at submission
    (``scheduling.services.templates.template_apply``): the image, command, ports, env, minimum
    GPU memory and volume mount path the request does not set itself; a template with
    ``volume_required`` is launched only with a volume. A workload records the template's name in
    ``Workload.template`` (warm pools match it) and keeps the filled-in values, so a later change
    to the template changes no workload."""

    tenant = models.ForeignKey(
        "portal.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="workload_templates"
    )
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True, max_length=2000)
    image = models.CharField(max_length=255)
    command = models.JSONField(default=list, blank=True, help_text="Arguments, as a JSON list of strings.")
    ports = models.JSONField(default=list, blank=True, help_text="Container ports, as a JSON list.")
    env = models.JSONField(default=dict, blank=True, help_text="Variables, as a JSON object of strings.")
    min_gpu_memory_gib = models.PositiveIntegerField(default=0)
    volume_mount_path = models.CharField(
        max_length=255,
        blank=True,
        help_text="Where a volume launched with it is mounted when the launch names no path; empty: none.",
    )
    volume_required = models.BooleanField(
        default=False,
        help_text="Launching from it needs a volume (the launch form offers to make one).",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = WorkloadTemplateQuerySet.as_manager()

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(volume_required=False) | ~Q(volume_mount_path=""),
                name="workloadtemplate_required_volume_has_path",
            ),
            models.UniqueConstraint(
                fields=["name"], condition=Q(tenant__isnull=True), name="workloadtemplate_catalog_name"
            ),
            models.UniqueConstraint(
                fields=["tenant", "name"],
                condition=Q(tenant__isnull=False),
                name="workloadtemplate_tenant_name",
            ),
        ]

    def __str__(self) -> str:
        return f"template {self.name}"

    @property
    def is_catalog(self) -> bool:
        return self.tenant_id is None


class LogStream(models.TextChoices):
    STDOUT = "stdout", "stdout"
    STDERR = "stderr", "stderr"


class WorkloadLogLine(models.Model):
    """One line a workload wrote, as its node's agent captured it (``scheduling.services.logs``).

    The id is the cursor the API pages and follows by (``since``). Not tenant-owned itself: it is
    reached only through a workload the tenant scoping already found. Kept for the retention of
    the workload's tenant's service plan (``WORKLOAD_LOG_RETENTION_DAYS``)."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="+", db_index=False)
    at = models.DateTimeField()
    stream = models.CharField(max_length=6, choices=LogStream.choices)
    text = models.TextField()

    class Meta:
        indexes = [
            models.Index(fields=["workload", "id"], name="workloadlogline_workload_id"),
            models.Index(fields=["at"], name="workloadlogline_at"),
        ]

    def __str__(self) -> str:
        return f"{self.workload_id} #{self.pk} {self.stream}: {self.text[:40]}"


class WorkloadLogBatch(models.Model):
    """A log batch a node sent (its ``seq``): a batch sent again is answered as a duplicate."""

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="+", db_index=False)
    seq = models.BigIntegerField()
    received_at = models.DateTimeField(default=timezone.now)
    lines = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "seq"], name="workloadlogbatch_node_seq")]
        indexes = [models.Index(fields=["received_at"], name="workloadlogbatch_received")]

    def __str__(self) -> str:
        return f"log batch {self.seq} of node {self.node_id}"


class SshKey(PersonOwnedModel):
    """A person's saved SSH public key. It opens the running instances of every tenant where the
    person's role may operate workloads (``scheduling.selectors.access``), checked at each login."""

    name = models.CharField(max_length=100)
    # Normalised by nodes.agent.workload_rules.parse_ssh_public_key: "type base64[ comment]".
    public_key = models.TextField()
    fingerprint = models.CharField(max_length=64, help_text="SHA256:..., as ssh-keygen -l prints it.")
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["-created", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["user", "fingerprint"], name="sshkey_unique_per_person")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint})"

    @property
    def kind(self) -> str:
        return self.public_key.split(" ", 1)[0]


class VolumeState(models.TextChoices):
    AVAILABLE = "available", "Available"
    DELETED = "deleted", "Deleted"


class Volume(TenantOwnedModel):
    """A tenant's persistent storage in one region: a directory on the region's shared filesystem
    (``VOLUME_STORAGE_ROOTS``), which every node of the region mounts at its agent's
    ``volumes_root``. The agent names the directory from the volume's id (``vol-<id>``), never
    from anything a payload says. It outlives the workloads that use it and is billed per GiB-hour
    of its size from ``created_at`` to ``deleted_at`` (metering's storage usage): ``size_gib`` now,
    earlier sizes from its ``resizes``."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="volumes")
    name = models.CharField(max_length=63)
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+")
    size_gib = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=VolumeState.choices, default=VolumeState.AVAILABLE)
    used_bytes = models.PositiveBigIntegerField(null=True, blank=True, help_text="As an agent last measured.")
    used_measured_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "region", "name"],
                condition=~Q(state="deleted"),
                name="volume_unique_live_name",
            ),
            models.CheckConstraint(condition=Q(size_gib__gte=1), name="volume_size_positive"),
            models.CheckConstraint(
                condition=Q(deleted_at__isnull=True) | Q(deleted_at__gte=F("created_at")),
                name="volume_deleted_after_created",
            ),
        ]

    def __str__(self) -> str:
        return f"volume {self.pk} ({self.name})"

    @property
    def size_bytes(self) -> int:
        return self.size_gib * 1024**3


class VolumeResize(TenantOwnedModel):
    """One change of a volume's size, at ``at``: storage billing charges ``from_gib`` before it and
    ``to_gib`` after it (metering's storage usage), so GiB-hours on either side are billed right."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    volume = models.ForeignKey(Volume, on_delete=models.CASCADE, related_name="resizes")
    at = models.DateTimeField(default=timezone.now)
    from_gib = models.PositiveIntegerField()
    to_gib = models.PositiveIntegerField()

    class Meta:
        ordering = ["volume_id", "at", "id"]
        indexes = [models.Index(fields=["volume", "at"], name="volumeresize_volume_at")]
        constraints = [
            models.CheckConstraint(
                condition=Q(from_gib__gte=1) & Q(to_gib__gte=1), name="volumeresize_positive"
            )
        ]

    def __str__(self) -> str:
        return f"volume {self.volume_id}: {self.from_gib} -> {self.to_gib} GiB at {self.at:%Y-%m-%d %H:%M}"


class WorkloadVolume(TenantOwnedModel):
    """A volume attached to a workload at ``mount_path``. The volume is in use while a workload it
    is attached to is not terminal; ``shared``: this workload agreed to share it with others that
    agreed too. The first one (lowest ``position``) holds a checkpointing job's checkpoints."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="volume_mounts")
    volume = models.ForeignKey(Volume, on_delete=models.PROTECT, related_name="mounts")
    mount_path = models.CharField(max_length=255)
    shared = models.BooleanField(default=False)
    position = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["workload_id", "position"]
        constraints = [
            models.UniqueConstraint(fields=["workload", "mount_path"], name="workloadvolume_one_per_path"),
            models.UniqueConstraint(fields=["workload", "volume"], name="workloadvolume_once"),
        ]
        indexes = [models.Index(fields=["volume", "workload"], name="workloadvolume_volume")]

    def __str__(self) -> str:
        return f"volume {self.volume_id} at {self.mount_path} of workload {self.workload_id}"


class DependencyCondition(models.TextChoices):
    SUCCEEDED = "succeeded", "Succeeded"  # Slurm's afterok
    FINISHED = "finished", "Finished"  # afterany: succeeded, failed or stopped


class WorkloadDependency(TenantOwnedModel):
    """A job that waits for another job of its tenant (``scheduling.services.dependencies``)."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="dependencies")
    on = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="dependents")
    condition = models.CharField(max_length=16, choices=DependencyCondition.choices)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["workload", "on"], name="workload_dependency_once"),
            models.CheckConstraint(condition=~Q(workload=F("on")), name="workload_dependency_not_self"),
        ]


class WorkItemState(models.TextChoices):
    PENDING = "pending", "Pending"
    LEASED = "leased", "Leased"
    DONE = "done", "Done"


class WorkItem(TenantOwnedModel):
    """One item (a frame range) of a work-queue array job, leased to one task at a time
    (``scheduling.services.work``)."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="work_items")
    index = models.PositiveIntegerField()
    first = models.IntegerField()
    last = models.IntegerField()
    state = models.CharField(max_length=8, choices=WorkItemState.choices, default=WorkItemState.PENDING)
    leased_to = models.ForeignKey(
        Workload, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    leased_attempt = models.PositiveIntegerField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    leases = models.PositiveIntegerField(default=0, help_text="Times it was handed out.")
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="work_item_once")]
        indexes = [models.Index(fields=["job", "state", "index"], name="work_item_next")]


class SlurmJob(models.Model):
    """The Slurm job a workload of a Slurm region became (``scheduling.services.slurm``): its id in
    that cluster (an array job's workload: the Slurm array job; each of its tasks: that id and the
    task's index), Slurm's state and reason as last read, how far its output file was read into the
    workload's log, and whether its accounting (sacct) has been turned into allocations."""

    workload = models.OneToOneField(Workload, on_delete=models.CASCADE, related_name="slurm_job")
    region = models.ForeignKey("nodes.Region", on_delete=models.PROTECT, related_name="+")
    job_id = models.BigIntegerField(help_text="Slurm's job id; of an array task, its array job's.")
    array_task_id = models.PositiveIntegerField(
        null=True, blank=True, help_text="An array task's index in its Slurm array job (<job_id>_<index>)."
    )
    account = models.CharField(max_length=64)
    partition = models.CharField(max_length=64, blank=True)
    gres = models.CharField(max_length=80, blank=True)
    output_path = models.CharField(max_length=255)
    state = models.CharField(max_length=32, blank=True, help_text="Slurm's, e.g. PENDING, RUNNING.")
    reason = models.CharField(max_length=64, blank=True, help_text="Slurm's pending reason.")
    submitted_at = models.DateTimeField(default=timezone.now)
    cancel_sent_at = models.DateTimeField(null=True, blank=True)
    output_offset = models.PositiveBigIntegerField(default=0)
    accounted_at = models.DateTimeField(null=True, blank=True)
    # The Slurm job ids of its earlier attempts (a job resubmitted under ``max_retries``): never
    # adopted again; the row follows the current attempt.
    earlier_job_ids = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            # A job, or an array job's own row (its array workload's), once per cluster; each task once.
            models.UniqueConstraint(
                fields=["region", "job_id"],
                condition=Q(array_task_id__isnull=True),
                name="slurmjob_region_job_id",
            ),
            models.UniqueConstraint(
                fields=["region", "job_id", "array_task_id"],
                condition=Q(array_task_id__isnull=False),
                name="slurmjob_region_job_task",
            ),
        ]
        indexes = [models.Index(fields=["accounted_at"], name="slurmjob_accounted_at")]

    def __str__(self) -> str:
        return f"slurm {self.region_id}:{self.job_id} for workload {self.workload_id}"
