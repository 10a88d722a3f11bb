"""Configuration of what runs: env for every workload, secret references resolved only on the way
to the node, and templates (the catalog and a tenant's own) that fill the spec at submission."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, NodeCommand
from nodes.services.commands import command_as_wire, node_commands_deliver_due
from portal.actors import Actor
from portal.models import AuditEvent
from portal.services.secrets import secret_create, secret_delete
from scheduling.models import Workload, WorkloadState, WorkloadTemplate
from scheduling.services.templates import template_create
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db

INSTANCE = {"gpu_models": ["H100"], "image": "ghcr.io/acme/notebook:1"}
JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture
def tapi(tenant, make_token, api):
    """The tenant's API client (every scope)."""
    return api(make_token(tenant))


def post(tapi, url, body):
    return tapi.post(url, body, content_type="application/json")


def delivered_start(node_id: int, workload: Workload) -> dict:
    """The start command as the node's long poll delivers it (the functions the agent view calls)."""
    commands, _ = node_commands_deliver_due(node_id=node_id)
    [wire] = [command_as_wire(c) for c in commands if c.kind == CommandKind.START_WORKLOAD]
    assert wire["payload"]["workload_id"] == str(workload.pk)
    return wire


# --- env ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "spec"), [("instances", INSTANCE), ("jobs", JOB)])
def test_env_is_kept_exactly_for_instances_and_jobs(tapi, make_node, path, spec):
    make_node()
    env = {"MODE": "  train ", "EMPTY": "", "UNICODE": "héllo ✓", "MULTI": "a\nb"}
    r = post(tapi, f"/api/v1/{path}/", {**spec, "env": env})
    assert r.status_code == 201, r.content
    assert r.json()["env"] == env
    assert Workload.objects.get(pk=r.json()["id"]).env == env


@pytest.mark.parametrize(
    "env",
    [
        {"1BAD": "x"},
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"LD_PRELOAD": "/x.so"},
        {"A": 5},
        {"A": ["x"]},
        {"A": {"secret": "nope!"}},
        {"A": {"secret": "K", "extra": 1}},
        {"A": {"value": "K"}},
        {"A": {"secret": "MISSING"}},
        ["A=1"],
    ],
)
def test_bad_env_is_a_400_naming_env_for_instances(tapi, make_node, env):
    make_node()
    r = post(tapi, "/api/v1/instances/", {**INSTANCE, "env": env})
    assert r.status_code == 400, r.content
    assert "env" in r.json()["error"]["fields"]
    assert not Workload.objects.exists()


# --- secrets -----------------------------------------------------------------------------------------


def test_a_secret_reaches_the_start_command_while_the_rows_keep_the_reference(tapi, tenant, make_node, cycle):
    node = make_node()
    assert post(tapi, "/api/v1/secrets/", {"name": "hf-token", "value": "hf_abc 123"}).status_code == 201
    env = {"HF_TOKEN": {"secret": "hf-token"}, "PLAIN": "yes"}
    r = post(tapi, "/api/v1/instances/", {**INSTANCE, "env": env})
    assert r.status_code == 201, r.content
    assert r.json()["env"] == env  # the API shows the reference
    w = Workload.objects.get(pk=r.json()["id"])
    cycle()
    assert reload(w).state == WorkloadState.SCHEDULED

    wire = delivered_start(node.pk, w)
    assert wire["payload"]["env"] == {"HF_TOKEN": "hf_abc 123", "PLAIN": "yes"}
    # Stored: the reference only, in the workload and in the command.
    assert reload(w).env == env
    stored = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    assert stored.payload["env"] == env and "hf_abc" not in str(stored.payload)
    assert b"hf_abc" not in tapi.get(f"/api/v1/instances/{w.pk}/").content

    # A replaced value reaches the next delivery (a redelivery of the same command here).
    tapi.put("/api/v1/secrets/hf-token/", {"value": "hf_new"}, content_type="application/json")
    NodeCommand.objects.filter(pk=stored.pk).update(next_attempt_at=stored.created_at)
    assert delivered_start(node.pk, w)["payload"]["env"]["HF_TOKEN"] == "hf_new"


def test_a_secret_deleted_before_the_start_fails_it_saying_which(
    tenant, owner, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    node = make_node()
    actor = Actor(user=owner)
    secret = secret_create(tenant=tenant, name="DB_PASS", value="pw", actor=actor)
    w = submit(tenant, "instance", env={"DB_PASS": {"secret": "DB_PASS"}})
    cycle()
    secret_delete(secret=secret, actor=actor)
    with django_capture_on_commit_callbacks(execute=True):
        commands, _ = node_commands_deliver_due(node_id=node.pk)
    assert commands == []  # nothing reached the node
    command = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    assert command.state == "failed" and "DB_PASS" in command.message
    w = reload(w)
    assert w.state == WorkloadState.FAILED
    last = w.events.order_by("-at", "-id").first()
    assert last.reason == "start_failed"
    assert last.message.startswith("Not started:") and "'DB_PASS' does not exist" in last.message


# --- templates ---------------------------------------------------------------------------------------


@pytest.fixture
def catalog(db, django_user_model):
    staff = django_user_model.objects.create_superuser(email="staff@example.com", password="x")
    return template_create(
        tenant=None,
        data={
            "name": "pytorch",
            "description": "PyTorch with Jupyter",
            "image": "nvcr.io/nvidia/pytorch:24.08-py3",
            "command": ["jupyter", "lab"],
            "ports": [8888],
            "env": {"JUPYTER_TOKEN": "", "MODE": "catalog"},
            "min_gpu_memory_gib": 40,
        },
        actor=Actor(user=staff),
    )


def test_launching_by_template_fills_the_spec(tapi, make_node, catalog):
    make_node()
    r = post(
        tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "template": "pytorch", "env": {"MODE": "mine"}}
    )
    assert r.status_code == 201, r.content
    w = Workload.objects.get(pk=r.json()["id"])
    assert (w.template, w.image, w.command, w.ports) == (
        "pytorch",
        "nvcr.io/nvidia/pytorch:24.08-py3",
        ["jupyter", "lab"],
        [{"port": 8888, "protocol": "http"}],
    )
    assert w.env == {"JUPYTER_TOKEN": "", "MODE": "mine"}  # the request's variable wins
    assert w.min_gpu_memory_gib == 40

    # What the request sets itself stays; a job takes the template's command but no ports.
    r = post(tapi, "/api/v1/jobs/", {"gpu_models": ["H100"], "template": "pytorch", "image": "ghcr.io/a/b:1"})
    assert r.status_code == 201, r.content
    job = Workload.objects.get(pk=r.json()["id"])
    assert (job.image, job.command, job.ports) == ("ghcr.io/a/b:1", ["jupyter", "lab"], [])

    # Changing the template later changes no stored workload.
    WorkloadTemplate.objects.filter(pk=catalog.pk).update(image="nvcr.io/nvidia/pytorch:25.01-py3")
    assert reload(w).image == "nvcr.io/nvidia/pytorch:24.08-py3"


def test_the_templates_minimum_gpu_memory_applies(tapi, make_node, catalog):
    make_node(model="NVIDIA L4", gpus=4)  # 24 GB: below the template's 40
    r = post(tapi, "/api/v1/instances/", {"gpu_models": ["NVIDIA L4"], "template": "pytorch"})
    assert r.status_code == 400 and "gpu_models" in r.json()["error"]["fields"]
    r = post(
        tapi,
        "/api/v1/instances/",
        {"gpu_models": ["NVIDIA L4"], "template": "pytorch", "min_gpu_memory_gib": 0},
    )
    assert r.status_code == 201, r.content


def test_an_unknown_template_is_a_400_naming_template(tapi, make_node):
    make_node()
    for name in ("nope", "bad name!"):
        r = post(tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "template": name})
        assert r.status_code == 400 and "template" in r.json()["error"]["fields"], r.content
    assert not Workload.objects.exists()


def test_templates_api_lists_both_kinds_and_crud_of_ones_own(
    tapi, tenant, make_node, catalog, make_tenant, make_token, api
):
    make_node()
    body = {
        "name": "my-llm",
        "image": "ghcr.io/acme/llm:2",
        "command": ["serve"],
        "ports": [8000, 8000],
        "env": {"A": "1"},
        "min_gpu_memory_gib": 20,
        "description": "Our server",
    }
    r = post(tapi, "/api/v1/templates/", body)
    assert r.status_code == 201, r.content
    mine = r.json()
    assert mine["catalog"] is False and mine["ports"] == [{"port": 8000, "protocol": "http"}]
    listed = {t["name"]: t["catalog"] for t in tapi.get("/api/v1/templates/").json()["results"]}
    assert listed == {"my-llm": False, "pytorch": True}

    r = tapi.patch(
        f"/api/v1/templates/{mine['id']}/", {"image": "ghcr.io/acme/llm:3"}, content_type="application/json"
    )
    assert r.status_code == 200 and r.json()["image"] == "ghcr.io/acme/llm:3"
    r = post(tapi, "/api/v1/instances/", {"gpu_models": ["H100"], "template": "my-llm"})
    assert r.status_code == 201 and r.json()["image"] == "ghcr.io/acme/llm:3"

    # The catalog is staff's: a tenant reads it, cannot change it.
    assert tapi.get(f"/api/v1/templates/{catalog.pk}/").status_code == 200
    r = tapi.patch(f"/api/v1/templates/{catalog.pk}/", {"image": "evil/x:1"}, content_type="application/json")
    assert r.status_code == 403
    assert tapi.delete(f"/api/v1/templates/{catalog.pk}/").status_code == 403

    # Another tenant: the catalog yes, this tenant's template no (404), nor launching from it.
    other = api(make_token(make_tenant("globex")))
    assert [t["name"] for t in other.get("/api/v1/templates/").json()["results"]] == ["pytorch"]
    assert other.get(f"/api/v1/templates/{mine['id']}/").status_code == 404
    assert (
        other.patch(
            f"/api/v1/templates/{mine['id']}/", {"image": "x/y:1"}, content_type="application/json"
        ).status_code
        == 404
    )
    assert other.delete(f"/api/v1/templates/{mine['id']}/").status_code == 404
    r = post(other, "/api/v1/instances/", {"gpu_models": ["H100"], "template": "my-llm"})
    assert r.status_code == 400 and "template" in r.json()["error"]["fields"]

    assert tapi.delete(f"/api/v1/templates/{mine['id']}/").status_code == 204
    actions = list(
        AuditEvent.objects.filter(tenant=tenant, action__startswith="template.").values_list(
            "action", flat=True
        )
    )
    assert sorted(actions) == ["template.create", "template.delete", "template.update"]
    assert AuditEvent.objects.filter(
        tenant=None, action="template.create", target_repr="template pytorch"
    ).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "image": "-rm"}, "image"),
        ({"name": "x", "image": "acme/UPPER:1"}, "image"),
        ({"name": "x"}, "image"),
        ({"image": "a/b:1"}, "name"),
        ({"name": "bad name", "image": "a/b:1"}, "name"),
        ({"name": "pytorch", "image": "a/b:1"}, "name"),  # a catalog template's name
        ({"name": "x", "image": "a/b:1", "ports": [0]}, "ports"),
        ({"name": "x", "image": "a/b:1", "env": {"LD_PRELOAD": "x"}}, "env"),
        ({"name": "x", "image": "a/b:1", "env": {"K": {"secret": "none"}}}, "env"),
        ({"name": "x", "image": "a/b:1", "command": "python"}, "command"),
        ({"name": "x", "image": "a/b:1", "min_gpu_memory_gib": -1}, "min_gpu_memory_gib"),
    ],
)
def test_bad_templates_are_400s_naming_the_field(tapi, catalog, body, field):
    r = post(tapi, "/api/v1/templates/", body)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"]
    assert WorkloadTemplate.objects.count() == 1


def test_read_tokens_list_templates_but_cannot_write(tenant, make_token, api, catalog):
    reader = api(make_token(tenant, scopes=("read",)))
    assert reader.get("/api/v1/templates/").status_code == 200
    assert post(reader, "/api/v1/templates/", {"name": "x", "image": "a/b:1"}).status_code == 403


def test_a_warm_pool_of_a_catalog_template_prewarms_its_image(tenant, make_node, regions, catalog):
    from nodes.models import GpuModel
    from scheduling.models import WarmPool
    from scheduling.services.warm_pools import warm_pools_reconcile

    make_node()
    WarmPool.objects.create(
        gpu_model=GpuModel.objects.get(name=H100), region=regions["us"], template="pytorch", min_size=1
    )
    warm_pools_reconcile()
    [command] = NodeCommand.objects.filter(kind=CommandKind.PREWARM)
    assert command.payload["image"] == "nvcr.io/nvidia/pytorch:24.08-py3"
