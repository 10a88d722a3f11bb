"""Each ``gpupool`` command against the live portal: its ``--json`` output is the API's objects,
its effect is in the database, and a refusal exits non-zero with the API's message."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from django.db import connections

from gpupool.cli import cli
from portal.models import ApiToken, TenantSecret
from scheduling.models import PublishedPort, Volume, Workload
from scheduling.services.lifecycle import workload_on_exited, workload_on_running
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db(transaction=True)

JOB = ["--gpus", "1", "--model", H100, "--image", "ghcr.io/acme/train:1"]


def job(*flags: str) -> list[str]:
    """``run``'s arguments for a one-GPU job with these flags."""
    return [*JOB, *flags, "--", "python", "train.py"]


def test_login_saves_a_profile_with_an_owner_only_token_file(gp, monkeypatch, tmp_path):
    monkeypatch.delenv("GPUPOOL_URL")
    monkeypatch.delenv("GPUPOOL_TOKEN")
    r = gp("ps", code=None)
    assert r.exit_code == 1 and "gpupool login" in r.stderr
    r = gp("login", "--url", gp.url, "--token", gp.token, "--profile", "lab")
    assert "Acme" in r.stderr
    creds = tmp_path / "config" / "credentials.json"
    assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
    assert json.loads(creds.read_text()) == {"lab": gp.token}
    assert gp.json("profiles") == {"default": "lab", "profiles": {"lab": {"url": gp.url}}}
    assert gp.json("ps") == []  # the saved profile works without the environment
    r = gp("login", "--url", gp.url, "--token", "gpp_wrong", "--profile", "bad", code=1)
    assert "401" in r.stderr
    assert "bad" not in gp.json("profiles")["profiles"]  # a refused login saves nothing
    gp("profiles", "rm", "lab")
    assert gp.json("profiles")["profiles"] == {}
    assert "lab" not in json.loads(creds.read_text())


def test_the_environment_wins_and_a_bad_token_exits_1(gp, monkeypatch):
    monkeypatch.setenv("GPUPOOL_TOKEN", "gpp_not_a_token")
    r = gp("gpus", code=1)
    assert r.stdout == ""
    assert "401" in r.stderr


def test_an_unreachable_portal_exits_3(gp, monkeypatch):
    monkeypatch.setenv("GPUPOOL_URL", "http://127.0.0.1:9")  # nothing listens on discard
    r = gp("ps", code=3)
    assert "cannot reach the portal" in r.stderr


def test_gpus_lists_the_catalog_with_free_gpus(gp, make_node):
    make_node(H100, gpus=8)
    types = gp.json("gpus")
    h100 = next(t for t in types if t["name"] == H100)
    assert h100["availability"][0]["region"] == "us-east-1"
    assert h100["availability"][0]["free_gpus"] == 8
    table = gp("gpus").stdout
    assert H100 in table and "us-east-1" in table
    assert gp.json("gpus", "--region", "nowhere")[0]["availability"] == []


def test_run_from_flags_then_ps_show_and_stop(gp, tenant, make_node):
    make_node(H100, gpus=8)
    gp("secrets", "set", "HF", input="hf-token-value\n")
    job = gp.json("run", *JOB, "--name", "train", "--env", "EPOCHS=3", "--secret", "HF_TOKEN=HF",
                  "--plan", "spot", "--", "python", "train.py", "--lr", "0.1")  # fmt: skip
    w = Workload.objects.get(pk=job["id"], tenant=tenant)
    assert w.command == ["python", "train.py", "--lr", "0.1"]
    assert w.env == {"EPOCHS": "3", "HF_TOKEN": {"secret": "HF"}}
    assert (w.plan, w.name, job["state"]) == ("spot", "train", "pending")
    listed = gp.json("ps")
    assert [x["id"] for x in listed] == [job["id"]]
    assert gp("ps").stdout.count("train") == 1
    shown = gp.json("show", job["id"])
    assert shown["id"] == job["id"] and "access" in shown
    assert "python train.py --lr 0.1" in gp("show", job["id"]).stdout
    stopped = gp.json("stop", job["id"])
    assert stopped[0]["state"] == "stopped"
    assert gp.json("ps") == []  # active only by default
    assert [x["id"] for x in gp.json("ps", "--all")] == [job["id"]]


def test_run_an_instance_from_a_yaml_spec(gp, tenant, make_node, tmp_path):
    make_node(H100, gpus=8)
    spec = tmp_path / "nb.yaml"
    spec.write_text(f"kind: instance\nname: notebook\ngpu_models: ['{H100}']\nimage: ghcr.io/acme/nb:1\n"
                    "ports: [8888]\nenv: {MODE: dev}\n")  # fmt: skip
    inst = gp.json("run", "--spec", spec, "--env", "EXTRA=1")
    w = Workload.objects.get(pk=inst["id"], tenant=tenant)
    assert (w.kind, w.name, w.env) == ("instance", "notebook", {"MODE": "dev", "EXTRA": "1"})
    assert inst["ports"] == [{"port": 8888, "protocol": "http"}]


def test_run_a_kubernetes_job_manifest(gp, tenant, make_node, tmp_path):
    make_node(H100, gpus=8)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: k8s-train, labels: {team: ml}}\nspec:\n"
        "  completions: 3\n  backoffLimit: 2\n  template:\n    spec:\n      restartPolicy: Never\n"
        "      containers:\n      - name: t\n        image: ghcr.io/acme/train:1\n"
        "        args: [python, train.py]\n"
        "        resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpu.model: H100}}\n"
    )
    r = gp("run", "--manifest", manifest)
    w = Workload.objects.get(tenant=tenant, name="k8s-train")
    assert (w.image, w.command, w.gpu_count, w.array_count, w.max_retries) == (
        "ghcr.io/acme/train:1",
        ["python", "train.py"],
        1,
        3,
        2,
    )
    assert "warning: metadata.labels" in r.stderr, r.stderr  # the API's warnings, shown
    # The API's refusal, by the manifest's path; flags cannot be mixed in.
    manifest.write_text(manifest.read_text().replace("nvidia.com/gpu: 1", "nvidia.com/gpu: 0"))
    r = gp("run", "--manifest", manifest, code=1)
    assert 'resources.limits["nvidia.com/gpu"]' in r.stderr, r.stderr
    assert "--manifest" in gp("run", "--manifest", manifest, "--gpus", "2", code=2).stderr
    assert Workload.objects.filter(tenant=tenant, array_parent=None).count() == 1


def test_run_elastic_then_resize(gp, tenant, make_node, cycle):
    node = make_node(H100, gpus=8)
    made = gp.json("run", "--model", H100, "--image", "img:1", "--elastic", "2:6:restart", "--", "x")
    w = Workload.objects.get(pk=made["id"])
    assert (w.elastic_min_gpus, w.elastic_max_gpus, w.elastic_on_resize, w.gpu_count) == (2, 6, "restart", 2)
    assert made["elastic"] == {"min_gpus": 2, "max_gpus": 6, "target_gpus": 6, "on_resize": "restart"}
    r = gp("resize", str(w.pk), "--gpus", "3", code=1)  # not running yet: the API's 409
    assert "running" in r.stderr, r.stderr
    cycle()
    workload_on_running(node_id=node.pk, workload_id=w.pk)
    cycle()  # grows to its maximum
    assert Workload.objects.get(pk=w.pk).gpu_count == 6
    out = gp.json("resize", str(w.pk), "--gpus", "3")
    assert out["gpu_count"] == 3 and out["elastic"]["target_gpus"] == 3
    assert "3 GPU(s) held" in gp("resize", str(w.pk), "--gpus", "3").stdout
    r = gp("resize", str(w.pk), "--gpus", "7", code=1)
    assert "gpu_count" in r.stderr, r.stderr
    assert "--elastic" in gp("run", *job("--elastic", "2-8"), code=2).stderr
    assert "on resize: restart" in gp("show", str(w.pk)).stdout


def test_array_depends_on_and_gang_reach_the_api(gp, tenant, make_node):
    make_node(H100, gpus=8)
    # --array and --depends-on are the API's fields: sent as such and checked there.
    first = gp.json("run", *job("--array", "10:2"))
    array = Workload.objects.get(pk=first["id"])
    assert (array.array_count, array.array_parallelism) == (10, 2)
    then = gp.json("run", *job("--depends-on", f"{array.pk}:succeeded"))
    assert [(d.on_id, d.condition) for d in Workload.objects.get(pk=then["id"]).dependencies.all()] == [
        (array.pk, "succeeded")
    ]
    r = gp("run", *job("--depends-on", "987654:succeeded"), code=1)  # the API's refusal, by name
    assert "depends_on" in r.stderr, r.stderr
    # --gang is a field the API knows: it is sent and checked (8 GPUs on 8-GPU nodes is a gang).
    ok = gp.json(
        "run", "--gpus", "8", "--model", H100, "--image", "ghcr.io/acme/train:1", "--gang", "--", "x"
    )
    assert Workload.objects.get(pk=ok["id"]).gang is True
    assert Workload.objects.filter(tenant=tenant, array_parent=None).count() == 3
    r = gp("run", "--array", "x", *job(), code=2)  # a malformed flag never reaches the API
    assert "--array" in r.stderr


def test_run_wait_finished_follows_the_job_to_its_end(gp, tenant, make_node, cycle):
    node = make_node(H100, gpus=8)

    def agent():
        w = None
        for _ in range(200):
            w = Workload.objects.filter(tenant=tenant).first()
            if w is not None:
                break
            time.sleep(0.05)
        cycle()
        workload_on_running(node_id=node.pk, workload_id=w.pk)
        time.sleep(0.3)
        workload_on_exited(node_id=node.pk, workload_id=w.pk, state="exited", exit_code=0)
        connections.close_all()

    thread = threading.Thread(target=agent)
    thread.start()
    try:
        done = gp.json("run", *job("--wait", "finished"))
    finally:
        thread.join()
    assert done["state"] == "succeeded" and done["exit_code"] == 0


def test_wait_on_a_job_that_fails_exits_1(gp, tenant, make_node, cycle):
    node = make_node(H100, gpus=8)

    def agent():
        for _ in range(200):
            w = Workload.objects.filter(tenant=tenant).first()
            if w is not None:
                break
            time.sleep(0.05)
        cycle()
        workload_on_exited(node_id=node.pk, workload_id=w.pk, state="failed", exit_code=3)
        connections.close_all()

    thread = threading.Thread(target=agent)
    thread.start()
    try:
        r = gp("run", *job("--wait", "finished"), code=1)
    finally:
        thread.join()
    assert "failed" in r.stderr
    assert r.stdout.split() == [str(Workload.objects.get(tenant=tenant).pk), "failed"]


def test_logs_and_follow(gp, tenant, submit, cycle):
    from tests.scheduling.logs_fixtures import batch, register_node

    node = register_node()
    job = submit(tenant, gpu_models=[H100])
    cycle()
    now = time.time()
    assert (
        node.send(batch(1, job, [[now, "stdout", "epoch 1"], [now + 0.001, "stderr", "warn"]])).status_code
        == 200
    )
    page = gp.json("logs", job.pk)
    assert [(x["stream"], x["text"]) for x in page["lines"]] == [("stdout", "epoch 1"), ("stderr", "warn")]
    r = gp("logs", job.pk)
    assert r.stdout == "epoch 1\n" and r.stderr == "warn\n"
    workload_on_exited(node_id=node.node.pk, workload_id=job.pk, state="exited", exit_code=0)
    # This live server is WSGI, which answers follow with a 400: the CLI polls instead, and stops
    # when the job has ended and printed everything.
    followed = gp("logs", "-f", job.pk, "--json").stdout.splitlines()
    assert [json.loads(x)["text"] for x in followed] == ["epoch 1", "warn"]


def test_ssh_and_open_say_why_not_and_the_other_tenant_is_404(gp, tenant, make_tenant, make_node, submit):
    make_node(H100, gpus=8)
    inst = gp.json("run", "--instance", *JOB, "--port", "8888")
    r = gp("ssh", inst["id"], code=1)  # pending: no node yet
    assert "error" in r.stderr and r.stdout == ""
    r = gp("open", inst["id"], "8888", code=1)
    assert r.stdout == ""
    r = gp("open", inst["id"], "9999", code=1)
    assert "does not publish port 9999" in r.stderr
    other = submit(make_tenant("globex"), gpu_models=[H100])
    assert gp("show", inst["id"]).exit_code == 0  # positive control: the same route, our own
    r = gp("show", other.pk, code=1)
    assert "404" in r.stderr


def test_ssh_runs_ssh_with_the_endpoint_and_its_host_key(gp, monkeypatch):
    from gpupool.cli import workloads

    access = {"ssh": {"host": "gpu-1.example.net", "port": 2222, "user": "42", "command": "ssh -p 2222 42@gpu-1",
                      "known_hosts": "[gpu-1.example.net]:2222 ssh-ed25519 AAAA"},
              "ssh_unavailable_reason": "", "ports": [], "share_link": None}  # fmt: skip

    class W:
        pass

    w = W()
    w.id, w.access = 42, access
    monkeypatch.setattr(workloads, "_find_workload", lambda c, id, kind: ("instance", w))
    ran = {}
    monkeypatch.setattr(os, "execv", lambda program, argv: ran.update(program=program, argv=argv))
    gp("ssh", "42", "--", "nvidia-smi")
    argv = ran["argv"]
    assert os.path.basename(ran["program"]) == "ssh"
    assert argv[1:3] == ["-p", "2222"] and argv[-2:] == ["42@gpu-1.example.net", "nvidia-smi"]
    known = next(a for a in argv if a.startswith("UserKnownHostsFile=")).split("=", 1)[1]
    assert Path(known).read_text().strip() == access["ssh"]["known_hosts"]


def test_volumes_secrets_and_templates(gp, tenant, regions, settings, api):
    settings.VOLUME_STORAGE_ROOTS = {"*": "/srv/volumes"}
    vol = gp.json("volumes", "create", "data", "--region", "us-east-1", "--size", "5")
    assert Volume.objects.get(pk=vol["id"], tenant=tenant).size_gib == 5
    assert [v["name"] for v in gp.json("volumes")] == ["data"]
    r = gp("volumes", "create", "data2", "--region", "us-east-1", "--size", "-1", code=1)
    assert "size_gib" in r.stderr
    gp("volumes", "rm", vol["id"])
    assert gp.json("volumes") == []  # a deleted volume is no longer listed
    assert Volume.objects.get(pk=vol["id"]).state == "deleted"

    gp("secrets", "set", "DB_PASSWORD", input="s3cret\n")
    assert [s["name"] for s in gp.json("secrets")] == ["DB_PASSWORD"]
    assert "s3cret" not in gp("secrets", "--json").stdout
    assert TenantSecret.objects.get(tenant=tenant).name == "DB_PASSWORD"
    gp("secrets", "rm", "DB_PASSWORD")
    assert gp.json("secrets") == []
    r = gp("secrets", "rm", "DB_PASSWORD", code=1)
    assert "404" in r.stderr

    made = api(gp.token).post("/api/v1/templates/", {"name": "torch", "image": "ghcr.io/acme/torch:2"},
                              content_type="application/json")  # fmt: skip
    assert made.status_code == 201
    listed = gp.json("templates")
    assert [(t["name"], t["image"], t["catalog"]) for t in listed] == [
        ("torch", "ghcr.io/acme/torch:2", False)
    ]
    assert "torch" in gp("templates").stdout


def test_tokens_create_list_revoke_and_a_read_token_cannot_write(gp, tenant, make_token, monkeypatch):
    made = gp.json("tokens", "create", "ci", "--scope", "read")
    assert made["token"].startswith("gpp_") and made["scopes"] == ["read"]
    assert "ci" in [t["name"] for t in gp.json("tokens")]
    monkeypatch.setenv("GPUPOOL_TOKEN", made["token"])
    r = gp("secrets", "set", "X", input="y", code=1)
    assert "403" in r.stderr
    monkeypatch.setenv("GPUPOOL_TOKEN", gp.token)
    revoked = gp.json("tokens", "revoke", made["id"])
    assert revoked["status"] == "revoked"
    assert ApiToken.objects.get(pk=made["id"]).revoked_at is not None


def test_completion_scripts(gp):
    for shell, marker in [
        ("bash", "complete -o"),
        ("zsh", "compdef"),
        ("fish", "complete --no-files --command gpupool"),
    ]:
        assert marker in gp("completion", shell).stdout


def test_quiet_in_a_pipe(gp, make_node):
    make_node(H100, gpus=8)
    r = CliRunner().invoke(cli, ["--json", "run", *job()], catch_exceptions=False)
    assert r.exit_code == 0 and r.stderr == ""  # no spinner, no chatter: only the object
    json.loads(r.stdout)


def test_open_prints_a_running_instances_proxy_url(gp, tenant, make_node, cycle):
    node = make_node(H100, gpus=8)
    inst = gp.json("run", "--instance", *JOB, "--port", "8888")
    cycle()
    workload_on_running(node_id=node.pk, workload_id=inst["id"])
    r = gp("open", inst["id"], "8888", code=1)  # the node has not said where it published it
    assert "Waiting for the node" in r.stderr
    # As the start command's result records it.
    PublishedPort.objects.create(
        workload_id=inst["id"], node=node, port=8888, protocol="http", host_port=31000
    )
    url = gp("open", inst["id"], "8888").stdout.strip()
    assert url.endswith(f"/proxy/{inst['id']}/8888/"), url
    assert gp.json("open", inst["id"], "8888")["url"] == url


def test_run_with_placement_flags(gp, tenant, make_node):
    make_node(H100, gpus=8)
    first = gp.json("run", *JOB, "--", "python", "a.py")
    job = gp.json("run", *JOB, "--node-selector", "rack=r12", "--node-selector", "pool=a",
                  "--anti-affinity", f"{first['id']}:rack", "--", "python", "b.py")  # fmt: skip
    w = Workload.objects.get(pk=job["id"], tenant=tenant)
    assert w.node_selector == {"rack": "r12", "pool": "a"}
    assert w.anti_affinity == {"workloads": [first["id"]], "topology_key": "rack"}
    arr = gp.json("run", *JOB, "--array", "4", "--spread", "rack:2", "--", "python", "c.py")
    assert Workload.objects.get(pk=arr["id"]).spread == {"topology_key": "rack", "max_skew": 2}
    refused = gp("run", *JOB, "--prefer", "fastest", "--", "python", "d.py", code=None)
    assert refused.exit_code == 1 and "preference" in refused.stderr
    bad = gp("run", *JOB, "--affinity", "x:rack", "--", "python", "e.py", code=None)
    assert bad.exit_code == 2


def test_run_with_minimum_versions(gp, tenant, make_node):
    make_node(H100, gpus=8)
    made = gp.json("run", *job("--min-driver", "550.54", "--min-cuda", "12.4"))
    w = Workload.objects.get(pk=made["id"], tenant=tenant)
    assert (w.min_driver, w.min_cuda, w.min_rocm) == ("550.54", "12.4", "")
    assert (made["min_driver"], made["min_cuda"], made["min_rocm"]) == ("550.54", "12.4", "")
    r = gp("run", *job("--min-cuda", "twelve"), code=1)
    assert "min_cuda" in r.stderr and "Not a version" in r.stderr
    r = gp("run", *job("--min-rocm", "6.1"), code=1)
    assert "min_rocm" in r.stderr
    assert Workload.objects.filter(tenant=tenant).count() == 1  # the refusals stored nothing
