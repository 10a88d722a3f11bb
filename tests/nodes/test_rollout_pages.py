"""The staff Rollouts pages through the Django test client: list, start form (400 naming the field),
the campaign's page with its nodes, pause/resume/abort buttons through the audited services, and 403
for people who are not staff (with staff's 200 on the same URLs as the positive control)."""

from __future__ import annotations

import pytest
from django.test import Client

from nodes.models import RolloutCampaign, RolloutState
from portal.models import AuditEvent, User

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_advance_tasks(settings):
    settings.ROLLOUT_ADVANCE_ON_COMMIT = False


@pytest.fixture
def staff_client(db) -> Client:
    client = Client()
    client.force_login(User.objects.create_user(email="ops@gpupool.example", password="x", is_staff=True))
    return client


FORM = {
    "name": "driver 560",
    "upgrade": "driver-560",
    "region": "us-east-1",
    "batch_size": "1",
    "max_region_share": "50%",
    "drain_deadline_s": "600",
    "step_timeout_s": "600",
}


def test_staff_start_a_campaign_and_steer_it_on_the_pages(staff_client, make_nodes):
    nodes = make_nodes(2)
    page = staff_client.get("/fleet/rollouts/")
    assert (
        page.status_code == 200 and b"Start a campaign" in page.content and b"No campaign yet" in page.content
    )
    assert b'href="/fleet/rollouts/"' in staff_client.get("/fleet/").content  # linked from the fleet

    started = staff_client.post("/fleet/rollouts/", FORM)
    campaign = RolloutCampaign.objects.get()
    assert started.status_code == 302 and started["Location"] == f"/fleet/rollouts/{campaign.pk}/"
    detail = staff_client.get(f"/fleet/rollouts/{campaign.pk}/")
    assert detail.status_code == 200
    for node in nodes:
        assert f'id="step-{node.hostname}" data-step-state="pending"'.encode() in detail.content
    assert (
        b"Pause" in detail.content
        and b"Abort" in detail.content
        and b'hx-trigger="every 5s"' in detail.content
    )
    assert b"driver 560" in staff_client.get("/fleet/rollouts/").content

    partial = staff_client.get(f"/fleet/rollouts/{campaign.pk}/", HTTP_HX_REQUEST="true")
    assert partial.status_code == 200 and partial.content.lstrip().startswith(
        b'<section class="card" id="rollout-progress"'
    )

    assert staff_client.post(f"/fleet/rollouts/{campaign.pk}/pause/", {"reason": "freeze"}).status_code == 302
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.PAUSED and campaign.state_reason == "freeze"
    refused = staff_client.post(f"/fleet/rollouts/{campaign.pk}/pause/", {})
    assert refused.status_code == 409 and b"cannot be paused" in refused.content
    assert b"Resume" in staff_client.get(f"/fleet/rollouts/{campaign.pk}/").content
    assert staff_client.post(f"/fleet/rollouts/{campaign.pk}/abort/", {}).status_code == 302
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.ABORTED
    aborted = staff_client.get(f"/fleet/rollouts/{campaign.pk}/")
    assert b"Abort</button>" not in aborted.content and b"every 5s" not in aborted.content
    assert AuditEvent.objects.filter(target_id=str(campaign.pk), action__startswith="rollout.").count() == 3
    assert staff_client.post(f"/fleet/rollouts/{campaign.pk}/reboot/", {}).status_code == 404


@pytest.mark.parametrize(
    "change, field",
    [
        ({"batch_size": "0"}, b"batch_size"),
        ({"max_region_share": "0"}, b"max_region_share"),
        ({"upgrade": "apt-get -y upgrade"}, b"upgrade"),
        ({"region": "", "gpu_model": "", "label": ""}, b"region"),
    ],
)
def test_a_bad_start_is_a_400_with_the_message_and_writes_nothing(staff_client, make_nodes, change, field):
    make_nodes(2)
    r = staff_client.post("/fleet/rollouts/", {**FORM, **change})
    assert r.status_code == 400 and b"field-error" in r.content
    assert f'id="id_{field.decode()}_error"'.encode() in r.content
    assert not RolloutCampaign.objects.exists()


def test_people_who_are_not_staff_get_403(staff_client, make_nodes, owner):
    make_nodes(2)
    staff_client.post("/fleet/rollouts/", FORM)
    campaign = RolloutCampaign.objects.get()
    urls = ["/fleet/rollouts/", f"/fleet/rollouts/{campaign.pk}/"]
    for url in urls:
        assert staff_client.get(url).status_code == 200  # positive control
    member = Client()
    member.force_login(owner)
    for url in urls:
        assert member.get(url).status_code == 403
    assert member.post("/fleet/rollouts/", FORM).status_code == 403
    assert member.post(f"/fleet/rollouts/{campaign.pk}/abort/", {}).status_code == 403
    assert Client().get(urls[0]).status_code == 302  # sign in first
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.RUNNING and RolloutCampaign.objects.count() == 1
