"""What tests/client/test_cli.py leaves out: ``run``'s --volume, --ssh-key, --template, --region,
--max-runtime and --idempotency-key with their effect on the stored workload; ``--json`` of ``ssh``
and the ``rm`` commands; and every API command, refused, exiting 1 with the API's message and
nothing on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from scheduling.models import PublishedPort, Workload, WorkloadVolume
from scheduling.services.lifecycle import workload_on_running
from tests.client.conftest import ROOT
from tests.scheduling.conftest import H100

pytestmark = pytest.mark.django_db(transaction=True)


def _public_key() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def test_run_with_a_volume_an_ssh_key_a_template_a_region_and_a_runtime(
    gp, tenant, make_node, settings, api, tmp_path
):
    settings.VOLUME_STORAGE_ROOTS = {"*": "/srv/volumes"}
    make_node(H100, gpus=8)
    vol = gp.json("volumes", "create", "data", "--region", "us-east-1", "--size", "5")
    made = api(gp.token).post("/api/v1/templates/", {"name": "torch", "image": "ghcr.io/acme/torch:2",
                              "command": ["jupyter", "lab"], "ports": [8888]}, content_type="application/json")  # fmt: skip
    assert made.status_code == 201, made.content
    key = _public_key()
    key_file = tmp_path / "id_ed25519.pub"
    key_file.write_text(key + "\n")
    inst = gp.json("run", "--instance", "--template", "torch", "--gpus", "1", "--model", H100,
                   "--region", "us-east-1", "--volume", f"{vol['id']}:/data", "--ssh-key", key_file,
                   "--max-runtime", "3600")  # fmt: skip
    w = Workload.objects.get(pk=inst["id"], tenant=tenant)
    assert (w.template, w.image, w.command, w.ports) == (
        "torch",
        "ghcr.io/acme/torch:2",
        ["jupyter", "lab"],
        [{"port": 8888, "protocol": "http"}],
    )
    assert (w.region.code, w.max_runtime_s, w.ssh_public_key) == ("us-east-1", 3600, key)
    attached = WorkloadVolume.objects.get(workload=w)
    assert (attached.volume_id, attached.mount_path) == (vol["id"], "/data")
    assert [v["volume"] for v in inst["volumes"]] == [vol["id"]]
    # The key given inline; then the refusals: a malformed flag (2), the API's (1, naming the field).
    other = gp.json("run", "--instance", "--gpus", "1", "--model", H100, "--image", "img:1", "--ssh-key", key)
    assert Workload.objects.get(pk=other["id"]).ssh_public_key == key
    assert "--volume" in gp("run", "--instance", *_flags(), "--volume", "data:/data", code=2).stderr
    r = gp("run", "--instance", *_flags(), "--volume", "987654:/data", code=1)
    assert "volumes" in r.stderr, r.stderr
    r = gp("run", "--instance", *_flags(), "--ssh-key", "not a key", code=1)
    assert "ssh_public_key" in r.stderr, r.stderr
    r = gp("run", "--instance", *_flags(), "--template", "no-such", code=1)
    assert "template" in r.stderr, r.stderr
    assert Workload.objects.filter(tenant=tenant).count() == 2


def _flags() -> list[str]:
    return ["--gpus", "1", "--model", H100, "--image", "img:1"]


def test_run_with_the_same_idempotency_key_makes_one_workload(gp, tenant, make_node):
    make_node(H100, gpus=8)
    first = gp.json("run", *_flags(), "--idempotency-key", "deploy-42", "--", "python", "a.py")
    again = gp.json("run", *_flags(), "--idempotency-key", "deploy-42", "--", "python", "a.py")
    assert again["id"] == first["id"] and Workload.objects.filter(tenant=tenant).count() == 1
    # The same key with another body is the API's 422, not a second workload.
    r = gp("run", *_flags(), "--idempotency-key", "deploy-42", "--", "python", "b.py", code=1)
    assert "422" in r.stderr and Workload.objects.filter(tenant=tenant).count() == 1
    # Without a key each run is its own workload.
    gp.json("run", *_flags(), "--", "python", "a.py")
    assert Workload.objects.filter(tenant=tenant).count() == 2


def test_json_of_ssh_and_of_the_rm_commands(gp, tenant, make_node, settings, monkeypatch):
    from gpupool.cli import workloads

    settings.VOLUME_STORAGE_ROOTS = {"*": "/srv/volumes"}
    info = {"host": "gpu-1.example.net", "port": 2222, "user": "42", "command": "ssh -p 2222 42@gpu-1",
            "known_hosts": "[gpu-1.example.net]:2222 ssh-ed25519 AAAA"}  # fmt: skip

    class W:
        id, access = 42, {"ssh": info, "ports": []}

    real = workloads._find_workload
    monkeypatch.setattr(workloads, "_find_workload", lambda c, id, kind: ("instance", W()))
    out = gp.json("ssh", "42", "--", "nvidia-smi")
    assert out["ssh"] == info and out["argv"][0] == "ssh"
    assert out["argv"][-2:] == ["42@gpu-1.example.net", "nvidia-smi"]
    monkeypatch.setattr(workloads, "_find_workload", real)
    vol = gp.json("volumes", "create", "data", "--region", "us-east-1", "--size", "5")
    assert gp.json("volumes", "rm", vol["id"]) == {"deleted": vol["id"]}
    gp("secrets", "set", "K", input="v")
    assert gp.json("secrets", "rm", "K") == {"deleted": "K"}


# Every command that calls the API, with arguments that reach it.
API_COMMANDS = [
    ["gpus"], ["ps"], ["show", "1"], ["logs", "1"], ["ssh", "1"], ["open", "1", "8888"], ["stop", "1"],
    ["resize", "1", "--gpus", "2"], ["run", "--gpus", "1", "--image", "i:1", "--", "x"],
    ["volumes"], ["volumes", "create", "v", "--region", "us-east-1", "--size", "1"], ["volumes", "rm", "1"],
    ["secrets"], ["secrets", "set", "K"], ["secrets", "rm", "K"], ["templates"], ["usage"], ["invoices"],
    ["invoices", "pdf", "1"], ["budget"], ["budget", "--set", "10"], ["tokens"],
    ["tokens", "create", "t", "--scope", "read"], ["tokens", "revoke", "1"], ["webhooks"],
    ["webhooks", "create", "https://hooks.example.com/x"], ["webhooks", "update", "1", "--disable"],
    ["webhooks", "rm", "1"], ["webhooks", "roll-secret", "1"], ["webhooks", "events"],
    ["webhooks", "deliveries"], ["webhooks", "delivery", "1"], ["webhooks", "redeliver", "1"],
]  # fmt: skip


def test_every_api_command_refused_exits_1_with_the_apis_message(gp, tenant, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # invoices pdf would write here
    assert gp("--json", "tokens").exit_code == 0  # the positive control: the real token works
    monkeypatch.setenv("GPUPOOL_TOKEN", "gpp_revoked_or_never_was")
    for args in API_COMMANDS:
        for json_flag in ([], ["--json"]):
            r = gp(*json_flag, *args, input="value\n", code=None)
            assert (r.exit_code, r.stdout) == (1, ""), (args, json_flag, r.exit_code, r.stdout, r.stderr)
            assert "error (401" in r.stderr, (args, r.stderr)
    assert list(tmp_path.iterdir()) == []


def test_login_json_is_who_the_token_is(gp):
    me = json.loads(gp("--json", "login", "--url", gp.url, "--token", gp.token, "--profile", "ci").stdout)
    assert me["tenant"]["slug"] == "acme" and "scopes" in me


def test_login_keeps_the_token_in_the_os_keyring_when_there_is_one(gp, monkeypatch, tmp_path):
    """Through keyring's documented calls (a backend in memory: none is on this machine)."""
    store: dict[tuple[str, str], str] = {}

    class FailKeyring:  # keyring.backends.fail.Keyring: what get_keyring() is without a backend
        pass

    fail = types.ModuleType("keyring.backends.fail")
    fail.Keyring = FailKeyring
    backends = types.ModuleType("keyring.backends")
    backends.fail = fail
    keyring = types.ModuleType("keyring")
    keyring.backends = backends
    keyring.get_keyring = lambda: object()
    keyring.set_password = lambda service, name, token: store.__setitem__((service, name), token)
    keyring.get_password = lambda service, name: store.get((service, name))
    keyring.delete_password = lambda service, name: store.pop((service, name))
    for name, module in (
        ("keyring", keyring),
        ("keyring.backends", backends),
        ("keyring.backends.fail", fail),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("GPUPOOL_NO_KEYRING", "GPUPOOL_URL", "GPUPOOL_TOKEN"):
        monkeypatch.delenv(name)
    creds = tmp_path / "config" / "credentials.json"

    r = gp("login", "--url", gp.url, "--token", gp.token, "--profile", "lab")
    assert "the OS keyring" in r.stderr
    assert store == {("gpupool", "lab"): gp.token} and not creds.exists()
    assert gp.json("ps") == []  # the token read back from the keyring
    gp("profiles", "rm", "lab")
    assert store == {}
    # keyring installed but no usable backend: the owner-only file instead.
    keyring.get_keyring = lambda: FailKeyring()
    r = gp("login", "--url", gp.url, "--token", gp.token, "--profile", "ci")
    assert str(creds) in r.stderr and json.loads(creds.read_text()) == {"ci": gp.token} and store == {}
    assert oct(creds.stat().st_mode & 0o777) == "0o600"


def test_open_browser_opens_the_proxy_url(gp, tenant, make_node, cycle, tmp_path):
    node = make_node(H100, gpus=8)
    inst = gp.json("run", "--instance", *_flags(), "--port", "8888")
    cycle()
    workload_on_running(node_id=node.pk, workload_id=inst["id"])
    PublishedPort.objects.create(
        workload_id=inst["id"], node=node, port=8888, protocol="http", host_port=31000
    )
    opened = tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\nprintf "%s" "$1" > {opened}\n')
    browser.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT / "client" / "src"),
           "GPUPOOL_URL": gp.url, "GPUPOOL_TOKEN": gp.token, "GPUPOOL_NO_KEYRING": "1",
           "GPUPOOL_CONFIG_DIR": str(tmp_path / "config"), "BROWSER": f"{browser} %s"}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "gpupool", "open", str(inst["id"]), "8888", "--browser"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url.endswith(f"/proxy/{inst['id']}/8888/") and opened.read_text() == url


def test_gpus_shows_the_list_prices_per_plan_and_region(gp, make_node):
    from datetime import timedelta
    from decimal import Decimal

    from django.utils import timezone

    from metering.models import GpuPrice, RateCard, RateCardVersion
    from nodes.models import GpuModel

    make_node(H100, gpus=8)
    card = RateCard.objects.create(name="List prices", is_default=True)
    version = RateCardVersion.objects.create(rate_card=card, number=1,
                                             effective_from=timezone.now() - timedelta(days=1))  # fmt: skip
    h100 = GpuModel.objects.get(name=H100)
    for plan, price in (("on_demand", "2.49"), ("spot", "0.99"), ("reserved", "1.75")):
        GpuPrice.objects.create(version=version, gpu_model=h100, plan=plan, price_per_gpu_hour=Decimal(price))
    [us] = next(t for t in gp.json("gpus") if t["name"] == H100)["availability"]
    assert (us["region"], us["free_gpus"], us["total_gpus"]) == ("us-east-1", 8, 8)
    prices = {plan: Decimal(v) for plan, v in us["price_per_gpu_hour"].items()}  # the API's text
    assert prices == {"on_demand": Decimal("2.49"), "spot": Decimal("0.99"), "reserved": Decimal("1.75")}
    row = next(line for line in gp("gpus").stdout.splitlines() if line.startswith(H100))
    assert row.split()[-6:] == ["us-east-1", "8", "8", "2.49", "0.99", "1.75"], row
