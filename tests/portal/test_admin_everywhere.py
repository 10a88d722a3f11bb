"""Every model of gpupool's apps has a Django admin page (or is edited inline on its parent's), and
every one of those pages opens for staff."""

import pytest
from django.apps import apps
from django.contrib import admin
from django.core.management import call_command
from django.urls import reverse

APPS = ("portal", "nodes", "scheduling", "metering", "webhooks")
pytestmark = pytest.mark.django_db


def _inline_models() -> set:
    return {
        inline.model
        for model_admin in admin.site._registry.values()
        for inline in getattr(model_admin, "inlines", [])
    }


def test_every_model_is_in_the_admin():
    inline = _inline_models()
    missing = [
        m._meta.label
        for a in APPS
        for m in apps.get_app_config(a).get_models()
        if m not in admin.site._registry and m not in inline
    ]
    assert missing == []


def test_the_admin_passes_djangos_checks():
    call_command("check", tags=["admin"])


def test_every_changelist_opens_for_staff(client, django_user_model):
    user = django_user_model.objects.create_superuser(email="root@example.com", password="x")
    client.force_login(user)
    opened = 0
    for model in admin.site._registry:
        if model._meta.app_label not in APPS:
            continue
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        assert client.get(url).status_code == 200, url
        opened += 1
    assert opened >= 30
