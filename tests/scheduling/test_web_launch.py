"""The launch page: the GPU list with availability and prices, the estimate fragment, launching
through the submission service, inline errors (unknown model, quota), and read-only roles."""

from __future__ import annotations

from decimal import Decimal

import pytest

from nodes.models import GpuModel
from portal.models import AuditEvent, Role
from scheduling.models import Quota, WarmPool, WarmSlot, Workload, WorkloadEvent
from scheduling.pricing import register_price_provider, unregister_price_provider
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)
from tests.scheduling.conftest import A100, H100
from tests.ssh_keys import public_key

pytestmark = pytest.mark.django_db

KEY = public_key()


class FixedPrices:
    """A price provider as metering registers one: per model and region, per plan."""

    def __init__(self, table):
        self.table = table

    def prices(self, *, gpu_model, region):
        return dict(self.table.get((gpu_model.name, region.code if region else None), {}))

    def spot_floor(self, *, gpu_model, region):
        return None


@pytest.fixture
def prices(regions):
    provider = FixedPrices(
        {
            (H100, "us-east-1"): {"on_demand": Decimal("2.50"), "spot": Decimal("1.10"), "reserved": None},
            (H100, "eu-west-1"): {"on_demand": Decimal("3.00"), "spot": Decimal("1.30"), "reserved": None},
            (A100, "us-east-1"): {"on_demand": Decimal("1.60"), "spot": Decimal("0.70"), "reserved": None},
        }
    )
    register_price_provider(provider)
    yield provider
    unregister_price_provider(provider)


@pytest.fixture
def fleet(make_node):
    return {
        "h100_us": make_node(H100, gpus=8, region="us"),
        "h100_eu": make_node(H100, gpus=4, region="eu"),
        "a100_us": make_node(A100, gpus=8, region="us"),
    }


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def launch_data(**overrides):
    data = {
        "kind": "instance",
        "name": "notebook",
        "gpu_model": H100,
        "gpu_count": "2",
        "fraction": "1000",
        "region": "us-east-1",
        "plan": "on_demand",
        "image": "ghcr.io/acme/notebook:1",
        "ssh_public_key": KEY,
    }
    data.update(overrides)
    return data


def test_the_page_lists_models_with_availability_per_region_and_prices_per_plan(client, fleet, prices):
    html = client.get("/launch/").content.decode()
    assert 'data-gpu-offer="NVIDIA H100 SXM 80GB"' in html and 'data-gpu-offer="NVIDIA A100 SXM 80GB"' in html
    assert "<code>us-east-1</code> 8/8" in html and "<code>eu-west-1</code> 4/4" in html
    assert "2.50 USD" in html and "1.10 USD" in html  # lowest on-demand and spot of the H100
    assert 'id="launch-submit"' in html
    # every input has a label (keyboard- and screen-reader-usable)
    for name in ("id_name", "id_image", "id_gpu_count", "id_fraction", "id_region", "id_plan", "id_command"):
        assert f'for="{name}"' in html, name


def test_the_estimate_follows_the_form(client, fleet, prices):
    r = client.get(
        "/launch/summary/",
        {"gpu_model": H100, "gpu_count": "3", "fraction": "1000", "plan": "on_demand", "region": "us-east-1"},
        **HTMX,
    )
    html = r.content.decode()
    assert r.status_code == 200 and html.lstrip().startswith('<section class="card launch-summary"')
    assert "7.50 USD" in html and "180.00 USD" in html  # 3 x 2.50 an hour, x 24 a day
    # no region: the dearest region that has the model (the scheduler may place it in any)
    html = client.get("/launch/summary/", {"gpu_model": H100, "gpu_count": "1", "plan": "spot"}, **HTMX)
    assert "1.30 USD" in html.content.decode() and "dearest region" in html.content.decode()
    # a half GPU
    html = client.get(
        "/launch/summary/",
        {"gpu_model": A100, "gpu_count": "1", "fraction": "500", "plan": "on_demand"},
        **HTMX,
    ).content.decode()
    assert "0.80 USD" in html
    # no price for the plan: said so, not a zero
    html = client.get("/launch/summary/", {"gpu_model": H100, "plan": "reserved"}, **HTMX).content.decode()
    assert 'data-estimate="none"' in html


def test_a_warm_pool_hit_is_shown_as_starting_in_seconds(client, fleet, regions):
    pool = WarmPool.objects.create(
        gpu_model=GpuModel.objects.get(name=H100), region=regions["us"], image="ghcr.io/acme/notebook:1"
    )
    node = fleet["h100_us"]
    for gpu in node.gpus.order_by("index")[:2]:
        WarmSlot.objects.create(pool=pool, node=node, gpu=gpu)
    query = {"gpu_model": H100, "gpu_count": "2", "region": "us-east-1", "image": "ghcr.io/acme/notebook:1"}
    assert "Starts in seconds" in client.get("/launch/summary/", query, **HTMX).content.decode()
    # more GPUs than warm slots, or another image: no promise
    assert (
        "Starts in seconds"
        not in client.get("/launch/summary/", {**query, "gpu_count": "3"}, **HTMX).content.decode()
    )
    assert (
        "Starts in seconds"
        not in client.get("/launch/summary/", {**query, "image": "x:1"}, **HTMX).content.decode()
    )


def test_launching_goes_through_the_submission_service(client, fleet, tenant, owner):
    r = client.post("/launch/", launch_data())
    w = Workload.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/workloads/{w.pk}/"
    assert (w.tenant, w.kind, w.name, w.gpu_count, w.region.code) == (
        tenant,
        "instance",
        "notebook",
        2,
        "us-east-1",
    )
    assert [m.name for m in w.gpu_models.all()] == [H100] and w.ssh_public_key == KEY
    assert w.other_regions_ok is False  # the box was not ticked: this region only
    assert w.state == "pending" and WorkloadEvent.objects.filter(workload=w, reason="submitted").exists()
    assert AuditEvent.objects.filter(action="instance.submit", actor_user=owner).exists()
    # a job with a command split like a shell would
    r = client.post(
        "/launch/",
        launch_data(
            kind="job", ssh_public_key="", command="python train.py --name 'big run'", gpu_count="1",
            other_regions_ok="on",
        ),
    )  # fmt: skip
    job = Workload.objects.get(kind="job")
    assert r.status_code == 302 and job.command == ["python", "train.py", "--name", "big run"]
    assert job.other_regions_ok is True


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"gpu_model": "NVIDIA Imaginary 1TB"}, "gpu_model", "Unknown GPU model"),
        ({"region": "mars-1"}, "region", "Unknown region"),
        ({"gpu_count": "9"}, "gpu_count", "At most 8 on one node"),
        ({"fraction": "500"}, "fraction", "A fraction applies to exactly one GPU"),
        ({"image": ""}, "image", "An instance needs an image or a template"),
        ({"kind": "job"}, "command", "A job needs a command"),
        ({"ssh_public_key": "not a key"}, "ssh_public_key", "The key type must be one of"),
        ({"ssh_public_key": public_key("rsa", bits=1024)}, "ssh_public_key", "at least 2048 bits"),
        ({"command": "python 'unclosed"}, "command", "Cannot split this command"),
        ({"gpu_count": "zero"}, "gpu_count", "Enter a whole number"),
    ],
)
def test_bad_input_shows_inline_next_to_its_field_and_stores_nothing(
    client, fleet, overrides, field, message
):
    r = client.post("/launch/", launch_data(**overrides))
    html = r.content.decode()
    assert r.status_code == 400
    error = html[html.index(f'id="id_{field}_error"') :]
    assert message in error[:400], error[:400]
    assert Workload.objects.count() == 0
    # what was typed stays in the form
    assert "notebook" in html


def test_a_quota_over_its_limit_shows_in_the_form_naming_the_quota(client, fleet, tenant):
    Quota.objects.create(tenant=tenant, max_gpus_total=3)
    assert client.post("/launch/", launch_data(gpu_count="2")).status_code == 302
    r = client.post("/launch/", launch_data(gpu_count="2"))
    html = r.content.decode()
    assert r.status_code == 403
    assert "Quota max_gpus_total exceeded: limit 3 GPUs, in use 2, this request 2." in html
    assert 'id="id_gpu_count_error"' in html and 'role="alert"' in html
    assert Workload.objects.count() == 1


def test_a_viewer_sees_the_page_but_cannot_launch(signed_in, add_member, tenant, fleet):  # noqa: F811
    viewer = signed_in(add_member(tenant, Role.VIEWER).user, tenant)
    html = viewer.get("/launch/").content.decode()
    assert 'id="launch-submit"' not in html and "can look but not launch" in html
    assert '<fieldset class="stack launch-fields" disabled>' in html
    r = viewer.post("/launch/", launch_data())
    assert r.status_code == 403 and Workload.objects.count() == 0
    billing = signed_in(add_member(tenant, Role.BILLING).user, tenant)
    assert billing.post("/launch/", launch_data()).status_code == 403


def test_the_nav_has_launch_and_workloads(client, fleet):
    html = client.get("/").content.decode()
    assert 'href="/launch/"' in html and 'href="/workloads/"' in html
    assert 'id="panel-workloads"' in html


def test_the_page_without_a_fleet_says_what_to_do(client, regions):
    html = client.get("/launch/").content.decode()
    assert "No GPUs in the fleet yet" in html


def test_signed_out_people_sign_in_first(db):
    from django.test import Client

    r = Client().get("/launch/")
    assert r.status_code == 302 and r["Location"].startswith("/login/")
