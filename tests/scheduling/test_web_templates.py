"""Templates' default volume mount (the API, launching by template, the launch form) and the
templates page (the catalog and the team's own, create, edit, delete, launch from one), through
the real views; and the share-link button, offered only where a port is reachable."""

from __future__ import annotations

import pytest

from portal.actors import Actor
from portal.models import AuditEvent, Role
from portal.services.secrets import secret_create
from scheduling.demo import DEMO_TEMPLATES, JUPYTER, templates_demo_seed
from scheduling.models import PublishedPort, Volume, Workload, WorkloadState, WorkloadTemplate, WorkloadVolume
from scheduling.services.templates import template_create
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db


@pytest.fixture
def tapi(tenant, make_token, api):
    return api(make_token(tenant))


@pytest.fixture
def web(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


@pytest.fixture
def notebook(db):
    """A catalog template that keeps its data on a volume at /workspace."""
    return template_create(
        tenant=None,
        data={
            "name": "notebook",
            "image": "ghcr.io/acme/notebook:1",
            "ports": [8888],
            "volume_mount_path": "/workspace",
            "volume_required": True,
        },
        actor=Actor.system(),
    )


def post(tapi, url, body):
    return tapi.post(url, body, content_type="application/json")


def launch_data(**overrides):
    data = {"kind": "instance", "name": "nb", "gpu_model": H100, "gpu_count": "1", "fraction": "1000",
            "plan": "on_demand", "image": "", "mount_path": ""}  # fmt: skip
    data.update(overrides)
    return data


# --- the API -----------------------------------------------------------------------------------------


def test_the_templates_api_takes_and_checks_the_volume_mount(tapi, tenant):
    r = post(tapi, "/api/v1/templates/", {"name": "mine", "image": "ghcr.io/a/b:1",
                                          "volume_mount_path": "/data", "volume_required": True})  # fmt: skip
    assert r.status_code == 201, r.content
    assert (r.json()["volume_mount_path"], r.json()["volume_required"]) == ("/data", True)
    t = WorkloadTemplate.objects.get(pk=r.json()["id"])
    assert (t.tenant, t.volume_mount_path, t.volume_required) == (tenant, "/data", True)
    assert AuditEvent.objects.filter(action="template.create", data__volume_mount_path="/data").exists()
    for body, field in (
        ({"volume_mount_path": "relative"}, "volume_mount_path"),
        ({"volume_mount_path": "/proc/x"}, "volume_mount_path"),
        ({"volume_mount_path": "/a/../etc"}, "volume_mount_path"),
        ({"volume_required": True}, "volume_mount_path"),  # needs a volume, but where?
    ):
        r = post(tapi, "/api/v1/templates/", {"name": "bad", "image": "ghcr.io/a/b:1", **body})
        assert r.status_code == 400 and field in r.json()["error"]["fields"], (body, r.content)
    # A change that would leave a needed volume without a path is refused the same way.
    r = tapi.patch(f"/api/v1/templates/{t.pk}/", {"volume_mount_path": ""}, content_type="application/json")
    assert r.status_code == 400 and "volume_mount_path" in r.json()["error"]["fields"]
    r = tapi.patch(f"/api/v1/templates/{t.pk}/", {"volume_required": False, "volume_mount_path": ""},
                   content_type="application/json")  # fmt: skip
    assert r.status_code == 200 and (r.json()["volume_mount_path"], r.json()["volume_required"]) == (
        "",
        False,
    )
    assert not WorkloadTemplate.objects.filter(name="bad").exists()


def test_launching_by_template_fills_the_volumes_mount_path_and_asks_for_one(
    tapi, tenant, make_node, regions, notebook
):
    make_node()
    v = Volume.objects.create(tenant=tenant, name="work", region=regions["us"], size_gib=10)
    # Without a volume: a 400 naming volumes, nothing saved.
    r = post(tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "template": "notebook"})
    assert r.status_code == 400 and "volumes" in r.json()["error"]["fields"], r.content
    assert "/workspace" in r.json()["error"]["fields"]["volumes"][0]
    assert not Workload.objects.exists()
    # With one and no path: the template's path.
    r = post(
        tapi,
        "/api/v1/instances/",
        {"gpu_models": ["H100"], "template": "notebook", "volumes": [{"volume": v.pk}]},
    )
    assert r.status_code == 201, r.content
    w = Workload.objects.get(pk=r.json()["id"])
    assert list(WorkloadVolume.objects.filter(workload=w).values_list("volume_id", "mount_path")) == [
        (v.pk, "/workspace")
    ]
    # A path of the request's own wins; a second volume still needs its own path.
    w.state = WorkloadState.STOPPED
    w.save(update_fields=["state"])
    r = post(tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "template": "notebook",
                                          "volumes": [{"volume": v.pk, "mount_path": "/mine"}]})  # fmt: skip
    assert r.status_code == 201, r.content
    assert WorkloadVolume.objects.get(workload_id=r.json()["id"]).mount_path == "/mine"
    # Without the template, no path is still a 400 naming volumes.
    Workload.objects.update(state=WorkloadState.STOPPED)
    r = post(
        tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "image": "x/y:1", "volumes": [{"volume": v.pk}]}
    )
    assert r.status_code == 400 and "volumes" in r.json()["error"]["fields"]


# --- the launch form ---------------------------------------------------------------------------------


def test_the_launch_form_starts_from_a_template_and_makes_its_volume(web, tenant, make_node, notebook):
    make_node()
    page = web.get("/launch/?template=notebook").content.decode()
    assert '<option value="notebook" selected>notebook</option>' in page
    assert 'name="mount_path" value="/workspace"' in page
    assert 'data-template-card="notebook"' in page and "Needs one" in page
    # The summary fragment follows the form: another template, another card; none, no card.
    assert "data-template-card" not in web.get("/launch/summary/?template=", **HTMX).content.decode()

    # No volume: the service's error, next to the volume field; nothing made.
    r = web.post("/launch/", launch_data(template="notebook"))
    assert r.status_code == 400 and 'id="id_volume_error"' in r.content.decode()
    # A new volume needs its region.
    r = web.post(
        "/launch/", launch_data(template="notebook", new_volume_name="work", new_volume_size_gib="5")
    )
    assert r.status_code == 400 and 'id="id_region_error"' in r.content.decode()
    # Refused by the volume service (a bad name): its error on the new volume's field, nothing made.
    r = web.post("/launch/", launch_data(template="notebook", new_volume_name="Bad Name",
                                         new_volume_size_gib="5", region="us-east-1"))  # fmt: skip
    assert r.status_code == 400 and 'id="id_new_volume_name_error"' in r.content.decode()
    assert not Volume.objects.exists() and not Workload.objects.exists()

    r = web.post("/launch/", launch_data(template="notebook", new_volume_name="work",
                                         new_volume_size_gib="5", region="us-east-1"))  # fmt: skip
    assert r.status_code == 302, r.content.decode()[-2000:]
    w = Workload.objects.get()
    volume = Volume.objects.get()
    assert (volume.tenant, volume.name, volume.size_gib, volume.region.code) == (
        tenant,
        "work",
        5,
        "us-east-1",
    )
    assert (w.template, w.image) == ("notebook", "ghcr.io/acme/notebook:1")
    assert list(WorkloadVolume.objects.filter(workload=w).values_list("volume_id", "mount_path")) == [
        (volume.pk, "/workspace")
    ]


def test_a_new_volume_is_not_kept_when_the_launch_is_refused(web, tenant, make_node, notebook):
    make_node()
    # The volume would be made, but the workload is refused (no GPU model meets 4096 GiB): no row.
    r = web.post("/launch/", launch_data(template="notebook", new_volume_name="work", new_volume_size_gib="5",
                                         region="us-east-1", gpu_model="NVIDIA B300"))  # fmt: skip
    assert r.status_code == 400, r.status_code
    assert not Volume.objects.exists() and not Workload.objects.exists()
    assert not AuditEvent.objects.filter(action="volume.create").exists()


# --- the templates page ------------------------------------------------------------------------------


def test_the_page_lists_the_catalog_and_the_teams_own_and_launches_from_one(
    web, tenant, notebook, make_tenant
):
    template_create(
        tenant=tenant, data={"name": "ours", "image": "ghcr.io/acme/ours:1"}, actor=Actor.system()
    )
    template_create(
        tenant=make_tenant("other"), data={"name": "theirs", "image": "x/y:1"}, actor=Actor.system()
    )
    html = web.get("/templates/").content.decode()
    assert 'data-templates="catalog"' in html and 'data-templates="own"' in html
    assert 'data-template="notebook"' in html and 'data-template="ours"' in html and "theirs" not in html
    assert 'href="/launch/?template=notebook"' in html and 'href="/launch/?template=ours"' in html
    # Edit and delete on the team's own only.
    assert html.count("data-template-edit") == 1 and html.count("data-template-delete") == 1
    assert "/templates/" in web.get("/launch/").content.decode()


def test_a_secret_reference_survives_an_edit_in_the_page(web, tenant, owner):
    secret_create(tenant=tenant, name="hf-token", value="hf_secret_value", actor=Actor(user=owner))
    t = template_create(
        tenant=tenant,
        data={"name": "llm", "image": "a/b:1", "env": {"MODE": "x", "HF_TOKEN": {"secret": "hf-token"}}},
        actor=Actor.system(),
    )
    form = web.get(f"/templates/{t.pk}/edit/").content.decode()
    assert "HF_TOKEN=hf-token" in form and "hf_secret_value" not in form
    r = web.post(f"/templates/{t.pk}/edit/", {**_values(t), "image": "a/b:2"})
    assert r.status_code == 302, r.content.decode()[-1500:]
    t.refresh_from_db()
    assert t.env == {"MODE": "x", "HF_TOKEN": {"secret": "hf-token"}} and t.image == "a/b:2"
    # A reference to a secret the team lacks is the service's error, on the field.
    r = web.post(f"/templates/{t.pk}/edit/", {**_values(t), "secret_env": "K=missing"})
    assert r.status_code == 400 and "missing" in r.content.decode()


def test_create_edit_and_delete_ones_own(web, tenant):
    r = web.post("/templates/", {"name": "trainer", "image": "ghcr.io/acme/train:2",
                                 "command": "python 'train it.py' --epochs 3", "ports": "8888, 22/tcp",
                                 "env": "MODE=train\nEMPTY=", "min_gpu_memory_gib": "16",
                                 "volume_mount_path": "/data", "volume_required": "on"})  # fmt: skip
    assert r.status_code == 302, r.content.decode()[-2000:]
    t = WorkloadTemplate.objects.get(name="trainer")
    assert (t.tenant, t.command, t.env, t.min_gpu_memory_gib) == (
        tenant, ["python", "train it.py", "--epochs", "3"], {"MODE": "train", "EMPTY": ""}, 16
    )  # fmt: skip
    assert t.ports == [{"port": 22, "protocol": "tcp"}, {"port": 8888, "protocol": "http"}]
    assert (t.volume_mount_path, t.volume_required) == ("/data", True)

    # The service's errors show on their field; nothing saved.
    for data, field in (
        ({"name": "x", "image": "not an image!"}, "image"),
        ({"name": "x", "image": "a/b:1", "volume_required": "on"}, "volume_mount_path"),
        ({"name": "x", "image": "a/b:1", "ports": "eighty"}, "ports"),
        ({"name": "trainer", "image": "a/b:1"}, "name"),
    ):
        r = web.post("/templates/", {"min_gpu_memory_gib": "0", **data})
        assert r.status_code == 400 and f'id="id_{field}_error"' in r.content.decode(), (data, r.status_code)
    assert WorkloadTemplate.objects.count() == 1

    form = web.get(f"/templates/{t.pk}/edit/").content.decode()
    assert 'value="python &#x27;train it.py&#x27; --epochs 3"' in form and "8888/http" in form
    r = web.post(
        f"/templates/{t.pk}/edit/", {**_values(t), "image": "ghcr.io/acme/train:3", "volume_required": ""}
    )
    assert r.status_code == 302
    t.refresh_from_db()
    assert (t.image, t.volume_required, t.command) == (
        "ghcr.io/acme/train:3",
        False,
        ["python", "train it.py", "--epochs", "3"],
    )
    assert AuditEvent.objects.filter(action="template.update", tenant=tenant).exists()

    r = web.post(f"/templates/{t.pk}/delete/", **HTMX)
    assert r.status_code == 200 and 'id="templates-lists"' in r.content.decode()
    assert "Template trainer deleted." in r.content.decode() and not WorkloadTemplate.objects.exists()


def _values(t: WorkloadTemplate) -> dict:
    from scheduling.views.templates import TemplateForm

    return {k: v for k, v in TemplateForm.initial_of(t).items() if v is not None and v is not False}


def test_permissions_are_the_apis(signed_in, tenant, notebook, make_tenant, add_member):  # noqa: F811
    ours = template_create(tenant=tenant, data={"name": "ours", "image": "a/b:1"}, actor=Actor.system())
    other = make_tenant("other")
    theirs = template_create(tenant=other, data={"name": "theirs", "image": "a/b:1"}, actor=Actor.system())
    owner = signed_in(add_member(tenant, Role.OWNER).user, tenant)
    # Positive control: the owner may edit and delete their own.
    assert owner.get(f"/templates/{ours.pk}/edit/").status_code == 200
    # A catalog template: 403, as in the API; another team's: 404.
    assert owner.get(f"/templates/{notebook.pk}/edit/").status_code == 403
    assert owner.post(f"/templates/{notebook.pk}/delete/").status_code == 403
    assert owner.get(f"/templates/{theirs.pk}/edit/").status_code == 404
    assert owner.post(f"/templates/{theirs.pk}/delete/").status_code == 404
    # A viewer reads the page (no form, no edit or delete) and can change nothing.
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    html = viewer.get("/templates/").content.decode()
    assert (
        'data-template="ours"' in html
        and "data-template-form" not in html
        and "data-template-edit" not in html
    )
    assert (
        viewer.post("/templates/", {"name": "v", "image": "a/b:1", "min_gpu_memory_gib": "0"}).status_code
        == 403
    )
    assert viewer.get(f"/templates/{ours.pk}/edit/").status_code == 403
    assert viewer.post(f"/templates/{ours.pk}/delete/").status_code == 403
    assert set(WorkloadTemplate.objects.values_list("name", flat=True)) == {"notebook", "ours", "theirs"}
    assert owner.post(f"/templates/{ours.pk}/delete/").status_code == 302
    assert not WorkloadTemplate.objects.filter(pk=ours.pk).exists()


# --- the share link: offered only where a port is reachable -----------------------------------------


def test_the_share_link_button_shows_only_for_a_reachable_http_port(web, tenant, make_node, submit, cycle):
    node = make_node()
    w = submit(tenant, kind="instance", ports=[8888])
    cycle()
    Workload.objects.filter(pk=w.pk).update(state=WorkloadState.RUNNING)
    # A simulated node published nothing: the page says so, and offers no share link.
    PublishedPort.objects.create(workload=w, node=node, port=8888, protocol="http", host_port=None,
                                 note="A simulated node runs no process: nothing listens on this port.")  # fmt: skip
    page = web.get(f"/workloads/{w.pk}/live/").content.decode()
    assert "nothing listens on this port" in page
    assert "data-share-create" not in page and "share link" not in page.lower()
    # Published: the link and the button.
    PublishedPort.objects.filter(workload=w).update(host_port=31000, note="")
    page = web.get(f"/workloads/{w.pk}/live/").content.decode()
    assert f'/proxy/{w.pk}/8888/" target="_blank"' in page and "data-share-create" in page


# --- the demo ----------------------------------------------------------------------------------------


def test_the_demo_team_launches_its_own_template_with_a_new_volume(web, tenant, make_node):
    make_node()
    assert templates_demo_seed(tenant) == len(DEMO_TEMPLATES) + 1
    assert templates_demo_seed(tenant) == 0
    html = web.get("/templates/").content.decode()
    assert 'href="/launch/?template=lab-notebook"' in html and 'data-template="pytorch-jupyter"' in html
    r = web.post("/launch/", launch_data(template="lab-notebook", new_volume_name="notebooks",
                                         new_volume_size_gib="10", region="us-east-1"))  # fmt: skip
    assert r.status_code == 302, r.content.decode()[-2000:]
    w = Workload.objects.get()
    # Jupyter serves under the proxy's path, in the volume.
    assert w.command == ["sh", "-c", JUPYTER]
    assert "--ServerApp.base_url=/proxy/$GPUPOOL_WORKLOAD_ID/8888/" in JUPYTER
    assert w.ports == [{"port": 8888, "protocol": "http"}]
    assert list(WorkloadVolume.objects.filter(workload=w).values_list("volume__name", "mount_path")) == [
        ("notebooks", "/workspace")
    ]
