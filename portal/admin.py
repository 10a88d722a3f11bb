from django import forms
from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from portal.actors import Actor
from portal.admin_actions import RecordAdmin, run_each
from portal.errors import DomainError
from portal.forms import AdminLoginForm, apply_domain_error
from portal.models import (
    ApiToken,
    AuditEvent,
    IdempotencyKey,
    Invitation,
    Membership,
    MetricValue,
    StaffScope,
    StaffToken,
    Tenant,
    TenantSecret,
    User,
)
from portal.services.invitations import invitation_revoke
from portal.services.members import membership_remove
from portal.services.tenants import tenant_set_status
from portal.services.tokens import api_token_revoke
from portal.staff_tokens import staff_token_create, staff_token_revoke

# The admin's sign-in goes through the same attempt limiter as the site's (portal.signin).
admin.site.login_form = AdminLoginForm


class ServiceOwnedAdmin(admin.ModelAdmin):
    """Rows only the services change (they revoke what a change takes away, and audit it): staff
    look here and act through the admin actions, which call those services."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    fields = ["user", "role", "created"]
    readonly_fields = ["user", "role", "created"]

    def has_add_permission(self, request, obj=None):
        return False  # people join by invitation; roles change on the team page or the API

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "full_name", "is_staff", "is_active", "last_login", "date_joined"]
    list_filter = ["is_staff", "is_superuser", "is_active"]
    search_fields = ["email", "full_name"]
    fieldsets = (
        (None, {"fields": ("email", "password")}),
        ("Profile", {"fields": ("full_name", "time_zone")}),
        ("Permissions", {"fields": ("is_active", "is_staff", "is_superuser", "groups", "user_permissions")}),
        ("Dates", {"fields": ("last_login", "date_joined")}),
    )
    add_fieldsets = ((None, {"classes": ("wide",), "fields": ("email", "password1", "password2")}),)


class TenantAdminForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = ["name", "slug", "billing_email", "currency", "status", "suspended_reason"]

    def clean(self):
        data = super().clean()
        needs_reason = data.get("status") in (Tenant.Status.SUSPENDED, Tenant.Status.GRACE)
        if needs_reason and not (data.get("suspended_reason") or "").strip():
            self.add_error(
                "suspended_reason", "Say why the tenant is suspended; its members and tokens see it."
            )
        return data


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "status", "currency", "billing_email", "member_count", "created"]
    list_filter = ["status", "currency"]
    search_fields = ["name", "slug", "billing_email"]
    readonly_fields = ["created"]
    inlines = [MembershipInline]
    form = TenantAdminForm
    actions = ["reactivate"]

    @admin.display(description="Members")
    def member_count(self, obj):
        return obj.memberships.count()

    def save_model(self, request, obj, form, change):
        # A status change goes through the service, so suspension and reactivation are audited.
        status_changed = change and "status" in form.changed_data
        if status_changed:
            new_status, reason = obj.status, obj.suspended_reason
            obj.status, obj.suspended_reason = form.initial["status"], form.initial["suspended_reason"]
        super().save_model(request, obj, form, change)
        if status_changed:
            tenant_set_status(tenant=obj, status=new_status, reason=reason, actor=Actor(user=request.user))

    @admin.action(description="Reactivate selected tenants")
    def reactivate(self, request, queryset):
        for tenant in queryset.filter(status=Tenant.Status.SUSPENDED):
            tenant_set_status(tenant=tenant, status=Tenant.Status.ACTIVE, actor=Actor(user=request.user))


@admin.register(Membership)
class MembershipAdmin(ServiceOwnedAdmin):
    list_display = ["user", "tenant", "role", "created"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__email", "tenant__slug", "tenant__name"]
    actions = ["remove_members"]

    @admin.action(description="Remove selected members (revokes their tokens and invitations)")
    def remove_members(self, request, queryset):
        run_each(
            self,
            request,
            queryset.select_related("tenant", "user"),
            lambda m, actor: membership_remove(membership=m, actor=actor),
            "Removed",
        )


@admin.register(Invitation)
class InvitationAdmin(ServiceOwnedAdmin):
    list_display = ["email", "tenant", "role", "invited_by", "created", "expires_at", "accepted_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["email", "tenant__slug"]
    exclude = ["token_hash"]
    actions = ["revoke_invitations"]

    @admin.action(description="Revoke selected open invitations")
    def revoke_invitations(self, request, queryset):
        run_each(
            self,
            request,
            queryset.filter(accepted_at__isnull=True).select_related("tenant"),
            lambda i, actor: invitation_revoke(invitation=i, actor=actor),
            "Revoked",
        )


@admin.register(ApiToken)
class ApiTokenAdmin(ServiceOwnedAdmin):
    list_display = [
        "name",
        "display_prefix",
        "tenant",
        "scopes",
        "status",
        "created",
        "expires_at",
        "last_used_at",
    ]
    list_filter = ["tenant"]
    search_fields = ["name", "key_id", "tenant__slug"]
    exclude = ["token_hash"]
    actions = ["revoke"]  # tokens are made by their tenant (UI, API or `createapitoken`), shown once

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request, queryset):
        for token in queryset.filter(revoked_at__isnull=True):
            api_token_revoke(token=token, actor=Actor(user=request.user))
        self.message_user(request, f"Revoked at {timezone.now():%Y-%m-%d %H:%M} UTC.")


class StaffTokenCreateForm(forms.Form):
    name = forms.CharField(max_length=100)
    scopes = forms.MultipleChoiceField(choices=StaffScope.choices, widget=forms.CheckboxSelectMultiple)
    expires_at = forms.DateTimeField(
        required=False, help_text="UTC, e.g. 2030-01-31 00:00. Empty: no expiry."
    )


@admin.register(StaffToken)
class StaffTokenAdmin(admin.ModelAdmin):
    """Staff make their own staff tokens here (shown once) and revoke them; superusers see everyone's."""

    list_display = [
        "name",
        "display_prefix",
        "user",
        "scopes",
        "status",
        "created",
        "expires_at",
        "last_used_at",
    ]
    search_fields = ["name", "key_id", "user__email"]
    actions = ["revoke"]

    def get_queryset(self, request):
        qs = super().get_queryset(request).select_related("user")
        return qs if request.user.is_superuser else qs.filter(user=request.user)

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    def has_add_permission(self, request):
        return request.user.is_active and request.user.is_staff

    def has_change_permission(self, request, obj=None):
        return False  # a token's scopes and person are fixed; revoke and make another

    def has_delete_permission(self, request, obj=None):
        return False  # revoked, not deleted, so the audit trail keeps its target

    def add_view(self, request, form_url="", extra_context=None):
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = StaffTokenCreateForm(request.POST or None)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": "Add staff token",
        }
        if request.method == "POST" and form.is_valid():
            try:
                token, plaintext = staff_token_create(
                    user=request.user, actor=Actor(user=request.user), **form.cleaned_data
                )
            except DomainError as exc:
                apply_domain_error(form, exc)
            else:  # the secret exists only in this response
                response = TemplateResponse(
                    request,
                    "admin/portal/stafftoken/add.html",
                    {**context, "token": token, "plaintext": plaintext},
                )
                add_never_cache_headers(response)
                return response
        return TemplateResponse(request, "admin/portal/stafftoken/add.html", {**context, "form": form})

    @admin.action(description="Revoke selected staff tokens")
    def revoke(self, request, queryset):
        run_each(
            self, request, queryset, lambda t, actor: staff_token_revoke(token=t, actor=actor), "Revoked"
        )


@admin.register(AuditEvent)
class AuditEventAdmin(RecordAdmin):
    list_display = ["created", "tenant", "actor_repr", "action", "target_repr"]
    list_filter = ["action", "actor_type", "tenant"]
    search_fields = ["actor_repr", "action", "target_repr", "target_id"]
    date_hierarchy = "created"


@admin.register(MetricValue)
class MetricValueAdmin(RecordAdmin):
    list_display = ["name", "labels", "bucket", "value", "gauge", "updated_at"]
    list_filter = ["gauge", "name"]
    search_fields = ["name", "labels"]


@admin.register(TenantSecret)
class TenantSecretAdmin(RecordAdmin):
    """Names and times only: a secret's value (even encrypted) is not shown to staff either."""

    list_display = ["name", "tenant", "created_at", "updated_at"]
    search_fields = ["name", "tenant__slug"]
    fields = ["tenant", "name", "created_at", "updated_at"]


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(RecordAdmin):
    """Which creates a key answered, and when (the stored answer, encrypted, is not shown: a token's
    create answers with its secret)."""

    list_display = ["key", "tenant", "route", "status_code", "created_at"]
    search_fields = ["key", "tenant__slug"]
    list_select_related = ["tenant"]
    fields = ["tenant", "key", "route", "request_hash", "status_code", "created_at"]
