"""Connecting a Slurm cluster as a region: the configuration's checks (every value reaches an argv
or a path) and ``manage.py slurm_region``, which reads the real cluster's inventory once."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from nodes.models import Gpu, Node, NodeState, Region, RegionBackend
from nodes.services.health import node_cordon
from nodes.slurm.config import slurm_config_parse
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import AuditEvent, User
from tests.slurm_cluster import NODE, NODE2, OUTPUT_DIR, SLURM_CONF

H100 = "NVIDIA H100 SXM 80GB"
REST = {
    "rest_url": "https://slurm.example:6820",
    "rest_user": "gpupool",
    "jwt_file": "/etc/gpupool/slurm.jwt",
}
GOOD = {"output_dir": "/srv/out", "partitions": {"default": "gpu"}, "gres_types": {H100: "h100"}}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"partitions": {"default": "gpu --uid=0"}}, "partitions"),
        ({"partitions": {"gold": "gpu"}}, "partitions"),
        ({"qos": {"spot": "$(id)"}}, "qos"),
        ({"gres_types": {H100: "h100:8"}}, "gres_types"),
        ({"output_dir": "relative/out"}, "output_dir"),
        ({"output_dir": "/srv/../etc"}, "output_dir"),
        ({"slurm_conf": "/etc/slurm/slurm.conf\n"}, "slurm_conf"),
        ({"connector": "ssh"}, "connector"),
        ({"connector": "rest"}, "rest_url"),
        ({"connector": "rest", **REST, "rest_url": "file:///etc/passwd"}, "rest_url"),
        ({"connector": "rest", **REST, "rest_url": "http://user@10.0.0.1:6820"}, "rest_url"),
        ({"connector": "rest", **REST, "rest_url": "http://10.0.0.1:6820/slurm?x=1"}, "rest_url"),
        ({"connector": "rest", **REST, "rest_user": "root --x"}, "rest_user"),
        ({"connector": "rest", **REST, "jwt_file": "token"}, "jwt_file"),
        ({"connector": "rest", **REST, "slurm_conf": "/etc/slurm/slurm.conf"}, "slurm_conf"),
        ({"rest_url": "http://10.0.0.1:6820"}, "rest_url"),  # the cli connector has no URL
        ({"timeout_s": 0}, "timeout_s"),
        ({"account_prefix": "Gp "}, "account_prefix"),
        ({"surprise": 1}, "slurm"),
    ],
)
def test_the_configuration_refuses_what_is_not_a_slurm_name_or_a_path(change, field):
    assert slurm_config_parse(GOOD).partition("spot") == "gpu"
    with pytest.raises(ValidationFailed) as err:
        slurm_config_parse({**GOOD, **change})
    assert field in err.value.fields


def test_the_rest_connector_takes_a_url_a_user_and_a_token_file():
    config = slurm_config_parse({**GOOD, "connector": "rest", **REST})
    assert (config.connector, config.rest_url, config.rest_user, config.jwt_file) == (
        "rest",
        "https://slurm.example:6820",
        "gpupool",
        "/etc/gpupool/slurm.jwt",
    )
    assert slurm_config_parse(GOOD).connector == "cli"


def test_rest_accounting_takes_the_exit_code_of_the_newest_record_of_a_job_id():
    """slurmdbd may hold an older job of the same id (ids wrap, or the controller's state was made
    anew): its unknown exit code (a FAILED record's 0, as 22.05 writes it) is not the new job's."""
    from nodes.slurm.rest import SlurmRest

    def record(state: str, submitted: int, code: int) -> dict:
        return {
            "job_id": 41,
            "state": {"current": state},
            "exit_code": {"status": "SUCCESS", "return_code": code},
            "time": {"submission": submitted, "start": submitted + 1, "end": submitted + 3, "elapsed": 2},
            "nodes": NODE,
            "tres": {"allocated": [{"type": "gres", "name": "gpu:h100", "count": 1}]},
        }

    rest = SlurmRest(slurm_config_parse({**GOOD, "connector": "rest", **REST}))
    answers = {"old": [record("FAILED", 1_700_000_000, 0), record("COMPLETED", 1_800_000_000, 0)]}
    rest.request = lambda method, path, **kw: {"jobs": answers["old"]}
    (acct,) = rest.accounting([41]).values()
    assert (acct.state, acct.exit_code) == ("COMPLETED", 0)
    answers["old"] = [record("COMPLETED", 1_700_000_000, 0), record("FAILED", 1_800_000_000, 0)]
    (acct,) = rest.accounting([41]).values()
    assert (acct.state, acct.exit_code) == ("FAILED", None)


@pytest.mark.django_db
def test_the_command_connects_the_cluster_and_reads_its_inventory(slurm_cluster, tmp_path, capsys):
    config = tmp_path / "hpc.json"
    config.write_text(
        json.dumps(
            {"slurm_conf": str(SLURM_CONF), "output_dir": str(OUTPUT_DIR), "gres_types": {H100: "h100"}}
        )
    )
    call_command("slurm_region", "hpc-2", "--name", "HPC", "--config", str(config))
    assert "Slurm lists 2 node(s) with 6 GPU(s)." in capsys.readouterr().out
    region = Region.objects.get(code="hpc-2")
    assert region.backend == RegionBackend.SLURM
    assert sorted(Node.objects.filter(region=region).values_list("labels__slurm_node", flat=True)) == [
        NODE,
        NODE2,
    ]
    node = Node.objects.get(region=region, labels__slurm_node=NODE)
    assert node.state == NodeState.SLURM
    mapped = Gpu.objects.filter(node=node, model__name=H100).count()
    assert mapped == 2 and Gpu.objects.filter(node=node, model__isnull=True).count() == 2  # a100 not mapped
    assert AuditEvent.objects.filter(action="region.slurm_created").count() == 1
    # Slurm's node state is Slurm's.
    with pytest.raises(Conflict):
        node_cordon(node=node, actor=Actor.system())
    # The staff fleet pages show it, with Slurm's own state.
    staff = User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)
    web = Client()
    web.force_login(staff)
    page = web.get(f"/fleet/nodes/{node.pk}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert node.hostname in text and "Run by Slurm" in text and node.state_reason in text
    assert web.get("/fleet/").status_code == 200

    config.write_text(json.dumps({"output_dir": str(OUTPUT_DIR), "slurm_conf": "/nonexistent/slurm.conf"}))
    with pytest.raises(CommandError, match="Slurm does not answer"):
        call_command("slurm_region", "hpc-3", "--name", "HPC", "--config", str(config))
    assert not Region.objects.filter(code="hpc-3").exists()


@pytest.mark.django_db
def test_a_region_whose_configuration_is_broken_is_reported_not_raised():
    from scheduling.services.slurm import slurm_region_sync

    region = Region.objects.create(code="hpc-9", name="Broken", backend=RegionBackend.SLURM, slurm={})
    assert slurm_region_sync(region=region).error == "configuration: output_dir is required."
