from django import forms
from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.utils import timezone

from portal import services
from portal.actors import Actor
from portal.admin_actions import RecordAdmin
from portal.models import ApiToken, AuditEvent, Invitation, Membership, MetricValue, Tenant, User


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]
    fields = ["user", "role", "created"]
    readonly_fields = ["created"]


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
            services.tenant_set_status(
                tenant=obj, status=new_status, reason=reason, actor=Actor(user=request.user)
            )

    @admin.action(description="Reactivate selected tenants")
    def reactivate(self, request, queryset):
        for tenant in queryset.filter(status=Tenant.Status.SUSPENDED):
            services.tenant_set_status(
                tenant=tenant, status=Tenant.Status.ACTIVE, actor=Actor(user=request.user)
            )


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__email", "tenant__slug", "tenant__name"]
    autocomplete_fields = ["user", "tenant"]


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["email", "tenant", "role", "invited_by", "created", "expires_at", "accepted_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["email", "tenant__slug"]
    readonly_fields = ["token_hash", "created", "accepted_at", "accepted_by"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
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
    readonly_fields = ["key_id", "token_hash", "created_by", "created", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # tokens are made by their tenant (UI, API or `createapitoken`) and shown once

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request, queryset):
        for token in queryset.filter(revoked_at__isnull=True):
            services.api_token_revoke(token=token, actor=Actor(user=request.user))
        self.message_user(request, f"Revoked at {timezone.now():%Y-%m-%d %H:%M} UTC.")


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
