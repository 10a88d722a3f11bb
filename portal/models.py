from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import AbstractUser, BaseUserManager
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from portal.tenancy import TenantOwnedModel, TenantQuerySet


class UserManager(BaseUserManager):
    use_in_migrations = True

    def _create_user(self, email: str, password: str | None, **extra):
        if not email:
            raise ValueError("An email address is required.")
        email = self.normalize_email(email).lower()
        user = self.model(email=email, **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_user(self, email: str, password: str | None = None, **extra):
        extra.setdefault("is_staff", False)
        extra.setdefault("is_superuser", False)
        return self._create_user(email, password, **extra)

    def create_superuser(self, email: str, password: str | None = None, **extra):
        extra.setdefault("is_staff", True)
        extra.setdefault("is_superuser", True)
        return self._create_user(email, password, **extra)


class User(AbstractUser):
    """A person. Signs in with an email address; belongs to tenants through memberships."""

    username = None  # type: ignore[assignment]
    email = models.EmailField("email address", unique=True)
    full_name = models.CharField(max_length=150, blank=True)
    time_zone = models.CharField(max_length=64, default="UTC")

    USERNAME_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    objects = UserManager()

    class Meta:
        ordering = ["email"]

    def __str__(self) -> str:
        return self.email

    @property
    def display_name(self) -> str:
        return self.full_name or self.email


slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use 1-50 lowercase letters, digits and hyphens, not starting or ending with a hyphen.",
)


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        GRACE = "grace", "Payment overdue"
        SUSPENDED = "suspended", "Suspended"

    class ServicePlan(models.TextChoices):
        """What a tenant's subscription includes beyond GPU hours; today, how long workload logs
        are kept (``WORKLOAD_LOG_RETENTION_DAYS``)."""

        STANDARD = "standard", "Standard"
        PRO = "pro", "Pro"
        ENTERPRISE = "enterprise", "Enterprise"

    name = models.CharField(max_length=120)
    slug = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    billing_email = models.EmailField()
    currency = models.CharField(max_length=3, default="USD")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    suspended_reason = models.CharField(max_length=255, blank=True)
    service_plan = models.CharField(max_length=16, choices=ServicePlan.choices, default=ServicePlan.STANDARD)
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        """Not suspended: a tenant in GRACE (payment overdue) works like an active one."""
        return self.status != self.Status.SUSPENDED

    @property
    def in_grace(self) -> bool:
        return self.status == self.Status.GRACE


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    BILLING = "billing", "Billing"
    VIEWER = "viewer", "Viewer"


class Scope(models.TextChoices):
    READ = "read", "Read"
    WRITE = "write", "Write"
    BILLING = "billing", "Billing"
    ADMIN = "admin", "Admin"


# What each role may do; a token can never carry more than its creator's role grants.
ROLE_SCOPES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset({Scope.READ, Scope.WRITE, Scope.BILLING, Scope.ADMIN}),
    Role.ADMIN: frozenset({Scope.READ, Scope.WRITE, Scope.BILLING, Scope.ADMIN}),
    Role.MEMBER: frozenset({Scope.READ, Scope.WRITE}),
    Role.BILLING: frozenset({Scope.READ, Scope.BILLING}),
    Role.VIEWER: frozenset({Scope.READ}),
}


class Membership(TenantOwnedModel):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["tenant", "user__email"]
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="membership_unique_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"

    @property
    def scopes(self) -> frozenset[str]:
        return ROLE_SCOPES[self.role]


def _new_secret(nbytes: int = 32) -> str:
    return secrets.token_urlsafe(nbytes)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Invitation(TenantOwnedModel):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    # Its sender's authority, now, is checked at acceptance; it goes with their account.
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "email"],
                condition=Q(accepted_at__isnull=True),
                name="invitation_unique_open_email",
            )
        ]

    def __str__(self) -> str:
        return f"Invitation of {self.email} to {self.tenant}"

    @property
    def is_open(self) -> bool:
        return self.accepted_at is None and self.expires_at > timezone.now()


class UsableTokens:
    """``usable()`` for a token queryset: not revoked, not expired."""

    def usable(self, now: datetime | None = None):
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))


class HashedToken(models.Model):
    """A bearer token ``<PREFIX>_<key_id>_<secret>`` of which only SHA-256 of the whole is stored:
    the fields and behaviour tenant and staff tokens share."""

    PREFIX: str

    name = models.CharField(max_length=100)
    # The public, recognisable part (shown in lists, used for lookup); the secret is never stored.
    key_id = models.CharField(max_length=16, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, editable=False)
    scopes = models.JSONField(default=list)
    created = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"{self.PREFIX}_{self.key_id}_…"

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def status(self) -> str:
        if self.is_revoked:
            return "revoked"
        if self.is_expired:
            return "expired"
        return "active"

    @classmethod
    def generate(cls) -> tuple[str, str, str]:
        """A new (key_id, plaintext token, hash of the token)."""
        key_id = secrets.token_hex(6)
        plaintext = f"{cls.PREFIX}_{key_id}_{_new_secret(32)}"
        return key_id, plaintext, hash_secret(plaintext)


class ApiTokenQuerySet(UsableTokens, TenantQuerySet):
    pass


class ApiToken(TenantOwnedModel, HashedToken):
    """A tenant's API token: ``gpp_<prefix>_<secret>``."""

    PREFIX = "gpp"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_tokens")
    # The person the token acts for: its authority is theirs, now (``effective_scopes``), and it
    # goes with their account. Empty only for a token the system made (``createapitoken``).
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )

    objects = ApiTokenQuerySet.as_manager()

    # What the token may do on this request: its scopes within what its creator's current role in
    # the tenant allows, set when it authenticates (``api_token_authenticate``); None when the
    # creator is inactive or no longer a member. Nothing until it has authenticated.
    effective_scopes: frozenset[str] | None = frozenset()

    class Meta(HashedToken.Meta):
        pass


class StaffScope(models.TextChoices):
    """What a staff token may open; staff APIs name the scope each route needs."""

    FINANCE_READ = "finance:read", "Read finance reports"
    SCHEDULING_WRITE = "scheduling:write", "Change scheduling settings (queue policies)"
    FLEET_WRITE = "fleet:write", "Run fleet operations (rolling upgrades, MIG layouts)"


class StaffTokenQuerySet(UsableTokens, models.QuerySet):
    pass


class StaffToken(HashedToken):
    """A staff person's token for the staff APIs (``/api/staff/v1/``): ``gps_<prefix>_<secret>``.

    Tied to no tenant and never accepted by the tenant API (nor a tenant's token by the staff APIs).
    It acts for the staff person it was made for and works only while that person is active staff."""

    PREFIX = "gps"

    # The staff person who made it and for whom it acts; it goes with their account.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="staff_tokens")

    objects = StaffTokenQuerySet.as_manager()

    class Meta(HashedToken.Meta):
        pass


class AuditEvent(TenantOwnedModel):
    """Who did what to which object, written by the services for every change a person makes."""

    class ActorType(models.TextChoices):
        USER = "user", "User"
        TOKEN = "token", "API token"
        SYSTEM = "system", "System"

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_token = models.ForeignKey(
        ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_repr = models.CharField(max_length=200)
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    target_repr = models.CharField(max_length=200, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created = models.DateTimeField(default=timezone.now, editable=False, db_index=True)

    class Meta:
        ordering = ["-created", "-id"]
        indexes = [models.Index(fields=["tenant", "-created"], name="audit_tenant_created")]

    def __str__(self) -> str:
        return f"{self.actor_repr} {self.action} {self.target_repr}"


SECRET_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class TenantSecret(TenantOwnedModel):
    """A value a tenant's workloads read from their environment (``{"KEY": {"secret": "NAME"}}``),
    stored encrypted (``portal.crypto``). Write-only: no page or API answer carries the value; it
    is decrypted only when a start command goes to a node (``portal.services.secrets``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(max_length=64, validators=[RegexValidator(SECRET_NAME_RE)])
    ciphertext = models.TextField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tenant_id", "name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="tenantsecret_unique_name")]

    def __str__(self) -> str:
        return f"secret {self.name}"


class MetricValue(models.Model):
    """A cumulative value that Celery workers produce for the web tier's ``/metrics`` (a worker's
    memory is not scraped): a counter, one histogram bucket (not cumulative: ``bucket`` is its
    upper bound, ``"sum"`` the sum of observations) or a last-value gauge. Written by
    ``portal.metrics.metrics_store`` (one upsert per call), read by ``StoredCollector``."""

    name = models.CharField(max_length=100)
    labels = models.CharField(max_length=255, blank=True, help_text="JSON list of the label values.")
    bucket = models.CharField(max_length=24, blank=True)
    value = models.FloatField(default=0)
    gauge = models.BooleanField(default=False, help_text="Set, not added to.")
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "labels", "bucket"], name="metricvalue_unique_series")
        ]

    def __str__(self) -> str:
        return f"{self.name}{self.labels}{self.bucket} = {self.value}"


class IdempotencyKey(TenantOwnedModel):
    """A create the API has answered (or is answering) under a client's ``Idempotency-Key``: the same
    key, route and body get the stored answer back (``portal.services.idempotency``)."""

    key = models.CharField(max_length=255)
    route = models.CharField(max_length=300)  # "POST /api/v1/jobs/"
    request_hash = models.CharField(max_length=64)  # SHA-256 of the request body
    status_code = models.PositiveSmallIntegerField(null=True)  # null while the first request runs
    # The answer's JSON, encrypted like tenant secrets (portal/crypto.py): a token's create answer
    # carries its secret, which must not sit in the database in the clear.
    response_encrypted = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"], name="idempotency_key_unique")]
        indexes = [models.Index(fields=["created_at"], name="idempotency_key_created")]

    def __str__(self) -> str:
        return f"{self.key} ({self.route})"
