"""The fleet: GPU catalog, regions, nodes, GPUs, node credentials, commands, telemetry and alerts.

Nodes are fleet objects, not tenant-owned: only staff and the node agents see them directly.
Telemetry tables (GpuSample, GpuMinuteRollup) are written with raw SQL on the ingest path
(``nodes.services.ingest``) for speed; the ORM models describe them for migrations, admin and reads.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from nodes.gang_network import GangNetworkError, gang_network_check


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(nbytes: int = 32) -> str:
    return secrets.token_urlsafe(nbytes)


# --- catalog -----------------------------------------------------------------------------------------


class Vendor(models.TextChoices):
    NVIDIA = "nvidia", "NVIDIA"
    AMD = "amd", "AMD"
    INTEL = "intel", "Intel"


class SoftwareStack(models.TextChoices):
    CUDA = "cuda", "CUDA"
    ROCM = "rocm", "ROCm"
    ONEAPI = "oneapi", "oneAPI (Level Zero)"


MIN_OVERSUBSCRIPTION = Decimal("1.00")
MAX_OVERSUBSCRIPTION = Decimal("4.00")


class GpuModel(models.Model):
    """One GPU product, from its public specification. ``compute_weight`` is relative to H100 SXM = 1.0
    (see ``nodes.catalog`` for the formula); staff may edit it and re-seeding keeps their value."""

    vendor = models.CharField(max_length=16, choices=Vendor.choices)
    name = models.CharField(max_length=80, unique=True)
    short_name = models.CharField(max_length=32, blank=True, help_text="e.g. H100, A100-80")
    architecture = models.CharField(max_length=32, blank=True)
    # Names that NVML / amdsmi / Level Zero report for this product, and names used by traces.
    aliases = models.JSONField(default=list, blank=True)
    memory_gib = models.PositiveIntegerField()
    bf16_tflops = models.DecimalField(
        max_digits=8, decimal_places=1, help_text="Dense BF16 (FP16 where BF16 is absent) tensor TFLOPS."
    )
    fp32_tflops = models.DecimalField(max_digits=8, decimal_places=1)
    memory_bandwidth_gbps = models.PositiveIntegerField(help_text="GB/s")
    compute_weight = models.DecimalField(max_digits=5, decimal_places=2)
    mig_capable = models.BooleanField(default=False)
    mig_profiles = models.JSONField(default=list, blank=True)
    oversubscription = models.DecimalField(
        max_digits=3,
        decimal_places=2,
        default=Decimal("1.00"),
        validators=[MinValueValidator(MIN_OVERSUBSCRIPTION), MaxValueValidator(MAX_OVERSUBSCRIPTION)],
        help_text=(
            "Fractional (non-MIG) shares on one GPU of this model may add up to this many GPUs "
            "(1.00: no over-subscription; at most 4.00). Each share's GPU memory limit is its share of "
            "the memory divided by this factor. Whole GPUs and MIG slices are never over-subscribed."
        ),
    )
    software_stack = models.CharField(max_length=16, choices=SoftwareStack.choices)
    cuda_compute_capability = models.CharField(max_length=8, blank=True, help_text="e.g. 9.0")
    gfx_target = models.CharField(
        max_length=16, blank=True, help_text="ROCm gfx target (gfx942) or Intel device family (pvc)"
    )
    spec_source = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["vendor", "name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(oversubscription__gte=MIN_OVERSUBSCRIPTION)
                & Q(oversubscription__lte=MAX_OVERSUBSCRIPTION),
                name="gpumodel_oversubscription_range",
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def cuda_cc_tuple(self) -> tuple[int, int] | None:
        if not self.cuda_compute_capability:
            return None
        major, _, minor = self.cuda_compute_capability.partition(".")
        return int(major), int(minor or 0)


class QueuePolicy(models.TextChoices):
    """How a region's queue is ordered (``scheduling.engine.queueing`` states each rule)."""

    DEFAULT = "", "Default: priority class, fair share, then arrival"
    FCFS = "fcfs", "First come, first served"
    SJF = "sjf", "Shortest job first (estimated runtime; none sorts last)"
    PRIORITY_AGING = "priority_aging", "Priority with aging (one class per hour waited)"


class RegionBackend(models.TextChoices):
    AGENTS = "agents", "gpupool agents"
    SLURM = "slurm", "A Slurm cluster"


class Region(models.Model):
    code = models.SlugField(max_length=32, unique=True)
    name = models.CharField(max_length=100)
    location = models.CharField(max_length=200, blank=True)
    queue_policy = models.CharField(max_length=20, choices=QueuePolicy.choices, blank=True, default="")
    queue_policy_by_plan = models.JSONField(default=dict, blank=True)
    """Per plan (``on_demand``, ``spot``, ``reserved``) a policy that replaces ``queue_policy``."""
    backend = models.CharField(max_length=16, choices=RegionBackend.choices, default=RegionBackend.AGENTS)
    slurm = models.JSONField(default=dict, blank=True)
    """A Slurm region's connection and mapping (``nodes.slurm.config``): empty for agent regions."""
    # The gang network (docker gangs with routable member addresses, docs/architecture.md): the
    # nodes' data network as a CIDR, the part of it reserved for containers (the portal hands each
    # gang member an address from it) and the route out (empty: none). Set by staff, never tenants;
    # empty: gangs get a bridge and a published rendezvous port only.
    gang_subnet = models.CharField(max_length=43, blank=True, help_text="e.g. 10.20.0.0/16")
    gang_range = models.CharField(
        max_length=43, blank=True, help_text="Addresses for gang members, within the subnet: 10.20.200.0/24"
    )
    gang_gateway = models.GenericIPAddressField(protocol="IPv4", null=True, blank=True)

    class Meta:
        ordering = ["code"]

    def __str__(self) -> str:
        return self.code

    def clean(self) -> None:
        try:
            gang_network_check(subnet=self.gang_subnet, range_=self.gang_range, gateway=self.gang_gateway)
        except GangNetworkError as exc:
            raise ValidationError({exc.field: exc.message}) from None


# --- nodes and GPUs ------------------------------------------------------------------------------------


class NodeState(models.TextChoices):
    READY = "ready", "Ready"
    CORDONED = "cordoned", "Cordoned"
    DRAINING = "draining", "Draining"
    SUSPECT = "suspect", "Suspect"
    DOWN = "down", "Down"
    MAINTENANCE = "maintenance", "Maintenance"
    # A node of a Slurm region: its inventory is read from Slurm, Slurm places work on it, and
    # gpupool's engine and heartbeat watch leave it alone (its Slurm state is in ``state_reason``).
    SLURM = "slurm", "Run by Slurm"


# States in which a node takes new work.
SCHEDULABLE_NODE_STATES = frozenset({NodeState.READY})


class Interconnect(models.TextChoices):
    NVSWITCH = "nvswitch", "NVLink through NVSwitch"
    NVLINK = "nvlink", "NVLink (point to point)"
    XGMI = "xgmi", "AMD Infinity Fabric (xGMI)"
    XE_LINK = "xe_link", "Intel Xe Link"
    PCIE = "pcie", "PCIe only"


class Node(models.Model):
    hostname = models.CharField(max_length=253, unique=True)
    # The agent's ``advertise_address``: how tenants (SSH) and the portal (published ports) reach it.
    address = models.CharField(
        max_length=253, blank=True, help_text="A DNS name or IP address; empty: the hostname."
    )
    region = models.ForeignKey(Region, on_delete=models.PROTECT, related_name="nodes")
    domain = models.CharField(
        max_length=64,
        blank=True,
        help_text="Rack or interconnect domain within the region; work split over nodes prefers one.",
    )
    # The agent's SSH endpoint into workloads (nodes/agent/ssh.py): its port on ``reach_address``
    # (null: the agent serves none) and its host key ("type base64"), for tenants' known_hosts.
    ssh_port = models.PositiveIntegerField(null=True, blank=True)
    ssh_host_key = models.TextField(blank=True)
    labels = models.JSONField(default=dict, blank=True)
    cpu_cores = models.PositiveIntegerField(default=0)
    ram_mib = models.PositiveBigIntegerField(default=0)
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField(max_length=32, blank=True)
    rocm_version = models.CharField(max_length=32, blank=True)
    level_zero_version = models.CharField(max_length=32, blank=True)
    # Hash of the versions (driver stack, GPU firmware) the last heartbeat carried: they are
    # written only when it changes (an upgrade), not every 10 s.
    versions_digest = models.CharField(max_length=32, blank=True, editable=False)
    agent_version = models.CharField(max_length=32, blank=True)
    interconnect = models.CharField(max_length=16, choices=Interconnect.choices, default=Interconnect.PCIE)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.READY)
    state_reason = models.CharField(max_length=255, blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    # The staff-chosen state a SUSPECT or DOWN node returns to when its heartbeats resume.
    resume_state = models.CharField(max_length=16, choices=NodeState.choices, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Sequence numbers restart at 1 when a node registers again (a reinstalled server): each
    # registration starts a new epoch, and (node, epoch, seq) identifies a heartbeat batch.
    seq_epoch = models.PositiveIntegerField(default=1)
    last_seq = models.BigIntegerField(default=0)
    status = models.JSONField(default=dict, blank=True, help_text="The agent's last reported status.")
    # Hash of the last workloads list a heartbeat carried: an unchanged list is not looked at again.
    workloads_digest = models.CharField(max_length=32, blank=True, editable=False)
    simulated = models.BooleanField(default=False, help_text="Part of the labelled simulated fleet.")

    class Meta:
        ordering = ["hostname"]
        # Nothing a heartbeat writes (last_heartbeat_at, last_seq, status, ...) is indexed, so that
        # PostgreSQL updates the row in place (a HOT update: no index entries, no index bloat) every
        # 10 s per node; the table leaves room for it in each page (fillfactor 70, migration 0006).
        # The silent-node sweep (services.health) reads the whole watched fleet anyway.
        indexes = [models.Index(fields=["state", "region"], name="node_state_region")]

    def __str__(self) -> str:
        return self.hostname

    @property
    def reach_address(self) -> str:
        """Where tenants and the portal reach the node."""
        return self.address or self.hostname

    @property
    def last_seen_at(self):
        return self.last_heartbeat_at or self.registered_at


class GpuHealth(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96, unique=True)
    model = models.ForeignKey(GpuModel, null=True, blank=True, on_delete=models.PROTECT, related_name="gpus")
    reported_name = models.CharField(max_length=128)
    memory_mib = models.PositiveIntegerField(default=0)
    pci_bus_id = models.CharField(max_length=32, blank=True)
    nvlink_island = models.SmallIntegerField(null=True, blank=True)
    numa_node = models.SmallIntegerField(null=True, blank=True)
    mig_mode = models.BooleanField(default=False)
    # The staff MIG layout the agent made ([{"profile", "start"}]; empty: instances are made per
    # workload), and whether a MIG reconfiguration is under way (no placements on the GPU from the
    # request until the agent answers): set by nodes.services.mig. The change asked for
    # (``mig_pending``: enable, layout, reason, requested_by, command) waits while work holds the GPU
    # (``mig_sent_at`` null: draining) and goes to the agent when the last of it has ended.
    mig_layout = models.JSONField(default=list, blank=True)
    mig_configuring = models.BooleanField(default=False)
    mig_pending = models.JSONField(null=True, blank=True)
    mig_requested_at = models.DateTimeField(null=True, blank=True)
    mig_sent_at = models.DateTimeField(null=True, blank=True)
    firmware_version = models.CharField(max_length=64, blank=True, help_text="VBIOS or GFX firmware.")
    health = models.CharField(max_length=16, choices=GpuHealth.choices, default=GpuHealth.HEALTHY)
    health_reason = models.CharField(max_length=255, blank=True)
    health_changed_at = models.DateTimeField(null=True, blank=True)
    isolated = models.BooleanField(default=False, help_text="Kept out of scheduling until staff return it.")
    # Set when a registration no longer lists this GPU (removed from the server).
    removed_at = models.DateTimeField(null=True, blank=True)
    # The latest sample, kept here so that /metrics and the UI read one row per GPU.
    last_sample_at = models.DateTimeField(null=True, blank=True)
    last_util_pct = models.FloatField(null=True, blank=True)
    last_mem_used_mib = models.IntegerField(null=True, blank=True)
    last_power_w = models.FloatField(null=True, blank=True)
    last_temp_c = models.SmallIntegerField(null=True, blank=True)
    last_sm_clock_mhz = models.IntegerField(null=True, blank=True)
    ecc_sbe_total = models.BigIntegerField(default=0)
    ecc_dbe_total = models.BigIntegerField(default=0)
    last_xid = models.IntegerField(null=True, blank=True)
    xid_count = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "index"], condition=Q(removed_at__isnull=True), name="gpu_unique_node_index"
            )
        ]
        indexes = [models.Index(fields=["health", "isolated"], name="gpu_health_isolated")]

    def __str__(self) -> str:
        return f"{self.node_id}/gpu{self.index} ({self.reported_name})"

    @property
    def schedulable(self) -> bool:
        return self.health == GpuHealth.HEALTHY and not self.isolated and self.removed_at is None


class UnknownGpuReport(models.Model):
    """A GPU name an agent reported that no catalog entry matches: flagged for staff."""

    reported_name = models.CharField(max_length=128, unique=True)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)
    gpu_count = models.PositiveIntegerField(default=0)
    example_node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_model = models.ForeignKey(
        GpuModel, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-last_seen_at"]

    def __str__(self) -> str:
        return self.reported_name


# --- credentials ---------------------------------------------------------------------------------------


class NodeBootstrapToken(models.Model):
    """``gpb_<key_id>_<secret>``: one use, optional region, an expiry unless staff asked for none; only
    its SHA-256 is stored. A token registers a new hostname; only a re-key token (``rekey_node``, made
    by staff for that node) registers an existing node's hostname, replacing its credential."""

    PREFIX = "gpb"

    key_id = models.CharField(max_length=16, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, editable=False)
    region = models.ForeignKey(Region, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    note = models.CharField(max_length=200, blank=True)
    # For the simulated fleet: the hostname this token was minted for (seed_demo re-uses it).
    intended_hostname = models.CharField(max_length=253, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    used_at = models.DateTimeField(null=True, blank=True)
    used_by_node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    rekey_node = models.ForeignKey(
        Node,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="A re-key token: it registers this node's hostname only, and replaces its credential.",
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.PREFIX}_{self.key_id}_…"

    @classmethod
    def generate(cls) -> tuple[str, str, str]:
        key_id = secrets.token_hex(6)
        plaintext = f"{cls.PREFIX}_{key_id}_{new_secret()}"
        return key_id, plaintext, hash_secret(plaintext)

    def is_usable(self, now) -> bool:
        return self.used_at is None and (self.expires_at is None or self.expires_at > now)


class NodeCredential(models.Model):
    """``gpn_<node_id>_<secret>``, returned once by register; registering again replaces it."""

    PREFIX = "gpn"

    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="credential")
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.PREFIX}_{self.node_id}_…"


# --- commands ------------------------------------------------------------------------------------------


class CommandKind(models.TextChoices):
    START_WORKLOAD = "start_workload", "Start workload"
    STOP_WORKLOAD = "stop_workload", "Stop workload"
    PREEMPT_WORKLOAD = "preempt_workload", "Preempt workload"
    PREWARM = "prewarm", "Prewarm"
    CONFIGURE_MIG = "configure_mig", "Configure MIG"
    DRAIN = "drain", "Drain"
    DELETE_VOLUME = "delete_volume", "Delete volume"
    UNDRAIN = "undrain", "Undrain"
    UPGRADE = "upgrade", "Upgrade"
    GPU_CHECK = "gpu_check", "GPU check"
    RESIZE_WORKLOAD = "resize_workload", "Resize workload"


class CommandState(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    ACCEPTED = "accepted", "Accepted"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"


OPEN_COMMAND_STATES = (CommandState.PENDING, CommandState.DELIVERED)
FINAL_COMMAND_STATES = frozenset({CommandState.SUCCEEDED, CommandState.FAILED, CommandState.EXPIRED})


class NodeCommand(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=32, choices=CommandKind.choices)
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=CommandState.choices, default=CommandState.PENDING)
    attempt = models.PositiveIntegerField(default=0, help_text="Deliveries so far.")
    max_attempts = models.PositiveIntegerField(default=5)
    next_attempt_at = models.DateTimeField(help_text="When it is (re)delivered if not acknowledged.")
    deadline = models.DateTimeField()
    idempotency_key = models.CharField(max_length=128, null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)
    message = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    accepted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="nodecommand_unique_idempotency_key",
            ),
        ]
        indexes = [
            # The long poll's query: open commands of one node that are due.
            models.Index(
                fields=["node", "next_attempt_at"],
                condition=Q(state__in=["pending", "delivered"]),
                name="nodecommand_due",
            ),
            models.Index(fields=["state", "deadline"], name="nodecommand_state_deadline"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.id} on {self.node_id} ({self.state})"

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_COMMAND_STATES


class NodeCommandEvent(models.Model):
    """Every thing that happened to a command: created, each delivery, each report, expiry."""

    command = models.ForeignKey(NodeCommand, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    event = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.command_id} {self.event} {self.from_state}->{self.to_state}"


class NodeWorkloadStatus(models.Model):
    """The last status a node reported for a workload; ``workload_exited`` fires on the transition."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="workload_statuses")
    workload_id = models.CharField(max_length=64)
    state = models.CharField(max_length=16)
    exit_code = models.IntegerField(null=True, blank=True)
    message = models.TextField(blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node_id", "workload_id"]
        constraints = [
            models.UniqueConstraint(fields=["node", "workload_id"], name="nodeworkload_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.workload_id} on {self.node_id}: {self.state}"


# --- heartbeats and telemetry ------------------------------------------------------------------------


class HeartbeatBatch(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="heartbeats")
    epoch = models.PositiveIntegerField(default=1)
    seq = models.BigIntegerField()
    received_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)
    sample_count = models.PositiveIntegerField(default=0)
    out_of_order = models.BooleanField(default=False)

    class Meta:
        ordering = ["node_id", "epoch", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["node", "epoch", "seq"], name="heartbeat_unique_node_seq"),
        ]
        indexes = [models.Index(fields=["received_at"], name="heartbeat_received")]

    def __str__(self) -> str:
        return f"heartbeat {self.node_id}#{self.seq}"


class SequenceGap(models.Model):
    """Heartbeat batches ``first_seq..last_seq`` (inclusive) that have not arrived (yet)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="sequence_gaps")
    epoch = models.PositiveIntegerField(default=1)
    first_seq = models.BigIntegerField()
    last_seq = models.BigIntegerField()
    detected_at = models.DateTimeField()
    filled_count = models.PositiveIntegerField(default=0, help_text="Batches that arrived late.")

    class Meta:
        ordering = ["node_id", "epoch", "first_seq"]
        indexes = [models.Index(fields=["node", "epoch", "first_seq"], name="seqgap_node_first")]

    def __str__(self) -> str:
        return f"gap {self.node_id}: {self.first_seq}..{self.last_seq}"

    @property
    def missing(self) -> int:
        return self.last_seq - self.first_seq + 1


class GpuSample(models.Model):
    """One raw per-GPU reading; kept ``TELEMETRY_RAW_RETENTION_DAYS`` days. Written in bulk at ingest.

    A gauge is NULL when the GPU could not report it (utilisation of a GPU in MIG mode, every gauge of
    a GPU that fell off the bus): "unknown", never 0.

    The GPU is a foreign key without a database constraint, on purpose (migration 0005): the
    constraint's check is one look-up of the GPU row per sample at commit, thousands a second at
    fleet scale, a large share of PostgreSQL's CPU. What keeps the rows
    consistent without it: ingest writes only GPUs it has just read under the node's lock; GPUs are
    retired (``removed_at``), not deleted; deleting one (or its node) still deletes its samples
    (Django's cascade); and the samples a GPU deleted while a batch of its node was being written
    leaves behind are deleted by the hourly purge (``nodes.services.telemetry``). Pages read samples
    by GPU, so such a sample shows meanwhile only in the admin's raw list."""

    gpu = models.ForeignKey(
        Gpu, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False
    )
    ts = models.DateTimeField()
    util_pct = models.FloatField(null=True, blank=True)
    mem_used_mib = models.IntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    temp_c = models.SmallIntegerField(null=True, blank=True)
    sm_clock_mhz = models.IntegerField(null=True, blank=True)
    ecc_sbe = models.IntegerField(default=0)
    ecc_dbe = models.IntegerField(default=0)
    throttle_reasons = models.BigIntegerField(default=0)
    xid_errors = models.JSONField(null=True, blank=True)
    processes = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["gpu", "ts"], name="gpusample_gpu_ts")]

    def __str__(self) -> str:
        return f"sample gpu {self.gpu_id} at {self.ts:%Y-%m-%d %H:%M:%S}"


class GpuMinuteRollup(models.Model):
    """Per GPU per minute, built at ingest by an additive upsert (so late batches land correctly).

    Join with allocation intervals on ``gpu_id`` and ``minute`` in ``[start, end)``. ``sample_count``
    counts readings; each gauge also counts the readings that reported it (NULLs are left out of its
    sum, count and max), so an average is ``<gauge>_sum / <gauge>_count`` and a max is NULL when no
    reading of the minute reported the gauge.
    """

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="+", db_index=False)
    minute = models.DateTimeField()
    sample_count = models.PositiveIntegerField(default=0)
    util_sum = models.FloatField(default=0)
    util_count = models.PositiveIntegerField(default=0)
    util_max = models.FloatField(null=True, blank=True)
    mem_used_sum = models.BigIntegerField(default=0)
    mem_used_count = models.PositiveIntegerField(default=0)
    mem_used_max = models.IntegerField(null=True, blank=True)
    power_sum = models.FloatField(default=0)
    power_count = models.PositiveIntegerField(default=0)
    temp_max = models.SmallIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["gpu_id", "minute"]
        constraints = [models.UniqueConstraint(fields=["gpu", "minute"], name="rollup_unique_gpu_minute")]
        indexes = [models.Index(fields=["minute"], name="rollup_minute")]

    def __str__(self) -> str:
        return f"rollup gpu {self.gpu_id} {self.minute:%Y-%m-%d %H:%M}"

    @property
    def util_avg(self) -> float | None:
        return self.util_sum / self.util_count if self.util_count else None

    @property
    def mem_used_avg_mib(self) -> float | None:
        return self.mem_used_sum / self.mem_used_count if self.mem_used_count else None

    @property
    def power_avg_w(self) -> float | None:
        return self.power_sum / self.power_count if self.power_count else None


class FleetAlert(models.Model):
    """Something staff must look at. At most one is open per kind and subject (for a GPU UUID
    conflict, the hostname that claimed another node's GPUs); a repeat updates the open one."""

    class Kind(models.TextChoices):
        MASS_SILENCE = "mass_silence", "A large share of the fleet went silent"
        GPU_UUID_CONFLICT = "gpu_uuid_conflict", "A registration claimed another node's GPUs"

    kind = models.CharField(max_length=32, choices=Kind.choices)
    subject = models.CharField(max_length=253, blank=True)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    opened_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "subject"],
                condition=Q(resolved_at__isnull=True),
                name="fleetalert_one_open_per_subject",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} at {self.opened_at:%Y-%m-%d %H:%M}"


# --- rolling upgrades ----------------------------------------------------------------------------------


class RolloutState(models.TextChoices):
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    ABORTED = "aborted", "Aborted"
    FAILED = "failed", "Failed"
    COMPLETED = "completed", "Completed"


# A campaign in these states may still drain, upgrade or return nodes.
OPEN_ROLLOUT_STATES = (RolloutState.RUNNING, RolloutState.PAUSED)


class RolloutStepState(models.TextChoices):
    PENDING = "pending", "Pending"
    DRAINING = "draining", "Draining"
    UPGRADING = "upgrading", "Upgrading"
    CHECKING = "checking", "Checking the GPUs"
    RETURNED = "returned", "Returned to service"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


# Steps whose node is out of service for the campaign now.
ACTIVE_STEP_STATES = (RolloutStepState.DRAINING, RolloutStepState.UPGRADING, RolloutStepState.CHECKING)


class RolloutCampaign(models.Model):
    """A rolling upgrade (``nodes.services.rollouts``): the nodes its selector chose when staff started
    it, drained a batch at a time within a share of each region, upgraded by the agent's configured
    ``upgrade`` (a name, never a command line), GPU-checked and returned; the first failure stops it."""

    name = models.CharField(max_length=100)
    upgrade = models.CharField(
        max_length=64, help_text="The name of an upgrade configured on the agents (their `upgrades` table)."
    )
    gpu_model = models.ForeignKey(GpuModel, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    region = models.ForeignKey(Region, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    label_key = models.CharField(max_length=63, blank=True)
    label_value = models.CharField(max_length=253, blank=True)
    batch_size = models.PositiveIntegerField(validators=[MinValueValidator(1), MaxValueValidator(1000)])
    max_region_share = models.DecimalField(
        max_digits=4,
        decimal_places=3,
        validators=[MinValueValidator(Decimal("0.001")), MaxValueValidator(Decimal("1"))],
        help_text="The most of a region's nodes out of service at once (0-1], counting every node not ready.",
    )
    drain_deadline_s = models.PositiveIntegerField(
        help_text="How long work may run on after a node starts draining; then what is left is preempted."
    )
    step_timeout_s = models.PositiveIntegerField(
        help_text="The longest the upgrade, and then the GPU check, may take on a node before it fails."
    )
    state = models.CharField(max_length=16, choices=RolloutState.choices, default=RolloutState.RUNNING)
    state_reason = models.TextField(blank=True)
    batches_started = models.PositiveIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(batch_size__gte=1), name="rollout_batch_size_positive"),
            models.CheckConstraint(
                condition=Q(max_region_share__gt=0) & Q(max_region_share__lte=1), name="rollout_share_range"
            ),
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk} {self.name}"

    @property
    def is_open(self) -> bool:
        return self.state in OPEN_ROLLOUT_STATES


class RolloutStep(models.Model):
    """One node of a campaign: pending, then draining, upgrading, checking, and returned (or failed,
    or cancelled when the campaign stopped first). ``command`` is the agent command it waits on."""

    campaign = models.ForeignKey(RolloutCampaign, on_delete=models.CASCADE, related_name="steps")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="rollout_steps")
    position = models.PositiveIntegerField()
    batch = models.PositiveIntegerField(null=True, blank=True, help_text="Which batch drained it (from 1).")
    state = models.CharField(
        max_length=16, choices=RolloutStepState.choices, default=RolloutStepState.PENDING
    )
    message = models.TextField(blank=True)
    command = models.ForeignKey(
        NodeCommand, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    drain_started_at = models.DateTimeField(null=True, blank=True)
    drain_deadline_at = models.DateTimeField(null=True, blank=True)
    notice_given_at = models.DateTimeField(null=True, blank=True)
    deadline_notice_at = models.DateTimeField(null=True, blank=True)
    command_started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["campaign_id", "position"]
        constraints = [
            models.UniqueConstraint(fields=["campaign", "node"], name="rolloutstep_unique_node"),
        ]
        indexes = [models.Index(fields=["state"], name="rolloutstep_state")]

    def __str__(self) -> str:
        return f"rollout {self.campaign_id} node {self.node_id}: {self.state}"
