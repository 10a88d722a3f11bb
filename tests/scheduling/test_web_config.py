"""The web side of configuration: env and secrets in the launch form, templates in it, the secrets
page (names only), and the demo's template catalog."""

from __future__ import annotations

import pytest

from portal.actors import Actor
from portal.models import AuditEvent, Role, TenantSecret
from portal.services.secrets import secret_create, secrets_resolve
from scheduling.demo import DEMO_TEMPLATES, templates_demo_seed
from scheduling.models import Workload, WorkloadTemplate
from scheduling.services.templates import template_create
from tests.portal.conftest import add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def launch_data(**overrides):
    data = {
        "kind": "instance",
        "name": "nb",
        "gpu_model": H100,
        "gpu_count": "1",
        "fraction": "1000",
        "plan": "on_demand",
        "image": "",
    }
    data.update(overrides)
    return data


def test_the_launch_form_sends_env_secrets_and_a_template(web, tenant, owner, make_node):
    make_node()
    secret_create(tenant=tenant, name="hf-token", value="hf_x", actor=Actor(user=owner))
    template_create(
        tenant=None,
        data={"name": "jupyter", "image": "ghcr.io/acme/jupyter:1", "ports": [8888], "env": {"A": "cat"}},
        actor=Actor.system(),
    )
    html = web.get("/launch/").content.decode()
    assert '<option value="jupyter">jupyter</option>' in html and 'name="env"' in html
    r = web.post(
        "/launch/",
        launch_data(template="jupyter", env="MODE= train \n\nA=mine=yes", secret_env="HF_TOKEN=hf-token"),
    )
    assert r.status_code == 302, r.content.decode()[-3000:]
    w = Workload.objects.get()
    assert (w.image, w.template, w.ports) == (
        "ghcr.io/acme/jupyter:1",
        "jupyter",
        [{"port": 8888, "protocol": "http"}],
    )
    assert w.env == {"A": "mine=yes", "MODE": " train ", "HF_TOKEN": {"secret": "hf-token"}}
    # The workload page shows the variables, a secret by its name, never its value.
    page = web.get(f"/workloads/{w.pk}/").content.decode()
    assert "<code>MODE</code>=<code> train </code>" in page and "secret hf-token" in page
    assert "hf_x" not in page

    # Restarted, it is launched from its template again, with the same env (the reference).
    Workload.objects.filter(pk=w.pk).update(state="stopped")
    assert web.post(f"/workloads/{w.pk}/restart/").status_code == 302
    again = Workload.objects.exclude(pk=w.pk).get()
    assert (again.image, again.template, again.env) == (w.image, "jupyter", w.env)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"image": "ghcr.io/a/b:1", "env": "NOEQUALS"}, "env"),
        ({"image": "ghcr.io/a/b:1", "env": "LD_PRELOAD=/x.so"}, "env"),
        ({"image": "ghcr.io/a/b:1", "secret_env": "K=missing"}, "env"),
        ({"template": "nope"}, "template"),
    ],
)
def test_launch_form_errors_show_on_their_field(web, make_node, overrides, field):
    make_node()
    r = web.post("/launch/", launch_data(**overrides))
    assert r.status_code == 400
    assert f'id="id_{field}_error"' in r.content.decode()
    assert not Workload.objects.exists()


def test_the_secrets_page_sets_replaces_and_deletes_without_showing_values(web, tenant):
    r = web.post("/secrets/", {"name": "DB_PASS", "value": "pa55 word"})
    assert r.status_code == 302
    html = web.get("/secrets/").content.decode()
    assert 'data-secret="DB_PASS"' in html and "pa55" not in html
    assert web.post("/secrets/", {"name": "DB_PASS", "value": "second"}).status_code == 302
    assert secrets_resolve(tenant_id=tenant.pk, names=["DB_PASS"]) == {"DB_PASS": "second"}
    r = web.post("/secrets/", {"name": "bad name", "value": "x"})
    assert r.status_code == 400 and 'id="id_name_error"' in r.content.decode()
    secret = TenantSecret.objects.get(name="DB_PASS")
    assert web.post(f"/secrets/{secret.pk}/delete/").status_code == 302
    assert not TenantSecret.objects.exists()
    actions = list(AuditEvent.objects.filter(action__startswith="secret.").values_list("action", flat=True))
    assert sorted(actions) == ["secret.create", "secret.delete", "secret.update"]


def test_viewers_see_names_only_and_other_tenants_get_404(
    web,
    tenant,
    owner,
    add_member,  # noqa: F811
    signed_in,  # noqa: F811
    make_tenant,
):
    secret = secret_create(tenant=tenant, name="KEEP", value="v", actor=Actor(user=owner))
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    html = viewer.get("/secrets/").content.decode()
    assert 'data-secret="KEEP"' in html and 'id="secret-save"' not in html
    assert viewer.post("/secrets/", {"name": "X", "value": "1"}).status_code == 403
    assert viewer.post(f"/secrets/{secret.pk}/delete/").status_code == 403
    other_tenant = make_tenant("globex")
    other = signed_in(add_member(other_tenant, Role.OWNER).user, other_tenant)
    assert 'data-secret="KEEP"' not in other.get("/secrets/").content.decode()
    assert other.post(f"/secrets/{secret.pk}/delete/").status_code == 404
    assert TenantSecret.objects.filter(pk=secret.pk).exists()


def test_the_demo_seeds_a_catalog_once():
    assert templates_demo_seed() == len(DEMO_TEMPLATES)
    assert templates_demo_seed() == 0
    assert set(WorkloadTemplate.objects.catalog().values_list("name", flat=True)) == {
        t["name"] for t in DEMO_TEMPLATES
    }


def test_staff_manage_the_catalog_in_the_admin_through_the_audited_service(client, django_user_model):
    staff = django_user_model.objects.create_superuser(email="root@example.com", password="x")
    client.force_login(staff)
    form = {
        "name": "tgi",
        "description": "Text generation",
        "image": "ghcr.io/huggingface/text-generation-inference:2.4",
        "command": "[]",
        "ports": "[80]",
        "env": '{"MAX_INPUT_TOKENS": "4096"}',
        "min_gpu_memory_gib": "24",
    }
    r = client.post("/admin/scheduling/workloadtemplate/add/", form)
    assert r.status_code == 302, r.content.decode()[-2000:]
    t = WorkloadTemplate.objects.get(name="tgi")
    assert (
        t.is_catalog
        and t.ports == [{"port": 80, "protocol": "http"}]
        and t.env == {"MAX_INPUT_TOKENS": "4096"}
    )
    event = AuditEvent.objects.get(action="template.create")
    assert event.tenant is None and event.actor_user == staff and event.data["env"] == ["MAX_INPUT_TOKENS"]

    # The workload rules apply: the error shows on its field and nothing changes.
    r = client.post(f"/admin/scheduling/workloadtemplate/{t.pk}/change/", {**form, "image": "--privileged"})
    assert r.status_code == 200 and "not start with" in r.content.decode()
    assert WorkloadTemplate.objects.get(pk=t.pk).image == form["image"]
    r = client.post(
        f"/admin/scheduling/workloadtemplate/{t.pk}/change/", {**form, "env": '{"LD_PRELOAD": "x"}'}
    )
    assert r.status_code == 200 and "LD_PRELOAD" in r.content.decode()

    assert (
        client.post(
            f"/admin/scheduling/workloadtemplate/{t.pk}/change/", {**form, "ports": "[80, 443]"}
        ).status_code
        == 302
    )
    assert WorkloadTemplate.objects.get(pk=t.pk).ports == [
        {"port": 80, "protocol": "http"},
        {"port": 443, "protocol": "http"},
    ]
    assert (
        client.post(f"/admin/scheduling/workloadtemplate/{t.pk}/delete/", {"post": "yes"}).status_code == 302
    )
    assert not WorkloadTemplate.objects.exists()
    assert sorted(
        AuditEvent.objects.filter(action__startswith="template.").values_list("action", flat=True)
    ) == [
        "template.create",
        "template.delete",
        "template.update",
    ]
