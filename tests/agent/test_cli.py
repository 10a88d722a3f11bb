"""The program as a process: SIGTERM shutdown keeps unsent data on disk; config precedence; the fleet."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodes.agent.buffer import Buffer
from nodes.agent.cli import main
from nodes.agent.config import AgentConfig, ConfigError, load_config
from nodes.agent.fleet import Fleet
from tests.agent.conftest import H100, wait_for
from tests.agent.fakeportal import FakePortal

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = "http://127.0.0.1:9"


def agent_process(portal: FakePortal, state_dir: Path, token: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["GPUPOOL_BOOTSTRAP_TOKEN"] = token
    env["GPUPOOL_ALLOW_INSECURE_HTTP"] = "1"  # the fake portal listens on loopback
    argv = [
        sys.executable,
        "-m",
        "nodes.agent.cli",
        "run",
        "--portal-url",
        portal.url,
        "--state-dir",
        str(state_dir),
        "--collector",
        "simulated",
        "--runtime",
        "simulated",
        "--hostname",
        "sim-cli-001",
        "--advertise-address",
        "127.0.0.1",
        "--heartbeat-interval",
        "0.1",
        "--commands-wait",
        "1",
        "--sim-gpus",
        json.dumps([{"model": H100, "count": 1}]),
    ]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_sigterm_flushes_what_it_can_and_keeps_the_rest(portal: FakePortal, tmp_path: Path) -> None:
    state = tmp_path / "state"
    token = portal.add_token()
    proc = agent_process(portal, state, token)
    try:
        wait_for(lambda: len(portal.seqs(1)) >= 3, timeout=30, what="heartbeats from the process")
        assert portal.nodes[1]["register"]["address"] == "127.0.0.1"
        portal.unavailable = True  # from now on nothing can be delivered
        time.sleep(0.6)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert time.monotonic() - began < 10
    assert "stopped" in stderr
    delivered = portal.seqs(1)
    with Buffer(state / "agent.sqlite3") as buffer:
        kept = [item.body["seq"] for item in buffer.pending()]
    assert kept, "the batches built during the outage are on disk"
    assert "kept in the buffer" in stderr
    assert kept == list(range(len(delivered) + 1, len(delivered) + len(kept) + 1))

    # The next start sends them first, then goes on; nothing lost, nothing doubled.
    portal.unavailable = False
    proc = agent_process(portal, state, token)
    try:
        wait_for(lambda: len(portal.seqs(1)) >= kept[-1] + 2, timeout=30, what="the kept batches")
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert portal.seqs(1) == list(range(1, len(portal.seqs(1)) + 1))
    assert portal.register_calls == 1


def test_config_precedence(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text(
        'portal_url = "http://file:8000"\nregion = "file-region"\nruntime = "subprocess"\n'
        'heartbeat_interval_s = 9\ncollector = "simulated"\n'
        '[labels]\nrack = "r1"\n[[sim_gpus]]\nmodel = "NVIDIA L4"\ncount = 2\n'
    )
    env = {
        "GPUPOOL_PORTAL_URL": "http://env:8000",
        "GPUPOOL_REGION": "env-region",
        "GPUPOOL_LABELS": "rack=r2,row=7",
        "GPUPOOL_STATE_DIR": "/tmp/env-state",
    }
    config = load_config(
        cli={"portal_url": "http://cli:8000", "region": None}, env=env, config_file=config_file
    )
    assert config.portal_url == "http://cli:8000"  # flag over env over file
    assert config.region == "env-region"  # env over file; an absent flag changes nothing
    assert config.labels == {"rack": "r2", "row": "7"}
    assert (config.runtime, config.collector, config.heartbeat_interval_s) == ("subprocess", "simulated", 9.0)
    assert config.state_dir == "/tmp/env-state"
    assert config.sim_gpus == [{"model": "NVIDIA L4", "count": 2}]
    assert load_config(env={"GPUPOOL_AGENT_CONFIG": str(config_file)}).region == "file-region"
    assert load_config(env={}).portal_url == ""

    with pytest.raises(ConfigError, match="collector must be one of"):
        AgentConfig(portal_url="https://x", collector="cuda").validate()
    with pytest.raises(ConfigError, match="portal_url is required"):
        AgentConfig().validate()
    with pytest.raises(ConfigError, match="labels: 'oops' is not key=value"):
        load_config(env={"GPUPOOL_LABELS": "oops"})
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        bad = tmp_path / "bad.toml"
        bad.write_text('colour = "blue"\n')
        load_config(env={}, config_file=bad)


def test_show_config_and_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_PORTAL_URL", "https://env:8000")
    monkeypatch.setenv("GPUPOOL_BOOTSTRAP_TOKEN", "gpb_1_abcdefghijklmnop")
    monkeypatch.setenv("GPUPOOL_ADVERTISE_ADDRESS", "gpu-h1.dc1.example")
    assert main(["show-config", "--label", "a=1", "--label", "b=2", "--hostname", "h1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["advertise_address"] == "gpu-h1.dc1.example"
    assert (shown["publish_address"], shown["tcp_publish_address"]) == ("127.0.0.1", "")
    assert shown["labels"] == {"a": "1", "b": "2"}
    assert shown["portal_url"] == "https://env:8000"
    assert shown["bootstrap_token"] == "gpb_1_ab..."  # never printed whole
    assert main(["--collector", "nvml", "--portal-url", "http:/bad"]) == 2
    assert "portal_url must start with http://" in capsys.readouterr().err


def test_fleet_waits_for_its_file_and_runs_every_node(portal: FakePortal, tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.json"
    fleet = Fleet(fleet_file, state_root=tmp_path / "agents", heartbeat_interval_s=0.1, file_poll_s=0.05)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(fleet.run())))
    thread.start()
    try:
        time.sleep(0.3)  # the launcher is up before the file exists
        nodes = [
            {
                "hostname": f"sim-{region}-{i:03d}",
                "region": region,
                "bootstrap_token": portal.add_token(),
                "cpu_cores": 64,
                "ram_mib": 524288,
                "interconnect": "nvswitch" if model == H100 else "pcie",
                "labels": {"rack": f"r{i}"},
                "gpus": [{"model": model, "count": count}],
                "price_plan": "ignored extra field",
            }
            for i, (region, model, count) in enumerate(
                [
                    ("us-east-1", H100, 8),
                    ("us-east-1", "NVIDIA L4", 4),
                    ("eu-west-1", "AMD Instinct MI300X", 8),
                ]
            )
        ]
        fleet_file.write_text(json.dumps({"portal_url": portal.url, "nodes": nodes, "version": 1}))
        wait_for(lambda: all(len(portal.seqs(n)) >= 2 for n in (1, 2, 3)), timeout=20, what="three nodes")
    finally:
        fleet.request_stop()
        thread.join(20)
    assert result == [0]
    registered = {n["hostname"]: n["register"] for n in portal.nodes.values()}
    assert set(registered) == {"sim-us-east-1-000", "sim-us-east-1-001", "sim-eu-west-1-002"}
    assert [g["name"] for g in registered["sim-eu-west-1-002"]["gpus"]] == ["AMD Instinct MI300X"] * 8
    assert registered["sim-us-east-1-001"]["interconnect"] == "pcie"
    assert registered["sim-eu-west-1-002"]["rocm_version"] == "6.2.0"
    assert (tmp_path / "agents" / "sim-us-east-1-000" / "credential.json").exists()


def test_a_fleet_spreads_its_agents_over_the_heartbeat_interval(tmp_path: Path) -> None:
    from nodes.agent.config import AgentConfig, ConfigError
    from nodes.agent.fleet import node_config

    phases = [
        node_config({"hostname": f"sim-{i:03d}"}, portal_url=LOOPBACK, state_root=tmp_path).heartbeat_phase
        for i in range(200)
    ]
    assert all(0 <= p < 1 for p in phases)
    assert len(set(phases)) == 200 and min(phases) < 0.1 and max(phases) > 0.9  # spread, not bunched
    again = node_config({"hostname": "sim-007"}, portal_url=LOOPBACK, state_root=tmp_path)
    assert again.heartbeat_phase == phases[7]  # the same host keeps its phase across restarts
    assert AgentConfig().heartbeat_phase == 0  # a real agent starts at once
    with pytest.raises(ConfigError, match="heartbeat_phase"):
        AgentConfig(portal_url="https://p", heartbeat_phase=1.0).validate()


def _loop_module() -> str:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    from nodes.agent.cli import run_event_loop

    return run_event_loop(which())


def test_the_agent_runs_on_uvloop_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GPUPOOL_EVENT_LOOP", raising=False)
    assert _loop_module().startswith("uvloop")
    monkeypatch.setenv("GPUPOOL_EVENT_LOOP", "asyncio")
    assert _loop_module().startswith("asyncio")
    monkeypatch.setenv("GPUPOOL_EVENT_LOOP", "trio")
    assert main(["show-config", "--portal-url", "http://portal.test"]) == 2
    assert "GPUPOOL_EVENT_LOOP: one of uvloop, asyncio, not 'trio'" in capsys.readouterr().err


def test_without_uvloop_the_agent_runs_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPOOL_EVENT_LOOP", raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert _loop_module().startswith("asyncio")


def test_plain_http_is_refused_unless_allowed_explicitly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The attack: over http:// the bootstrap token, the node credential and tenants' start commands
    (env, SSH keys) cross the network in clear text. The agent refuses it (exit 2, as any setting)."""
    for name in [k for k in os.environ if k.startswith("GPUPOOL_")]:
        monkeypatch.delenv(name)
    flags = ["--collector", "simulated", "--runtime", "simulated", "--state-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    argv = [sys.executable, "-m", "nodes.agent.cli", "run", "--bootstrap-token", "gpb_1_x", *flags]
    run = subprocess.run(
        [*argv, "--portal-url", "http://127.0.0.1:9"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "GPUPOOL_ALLOW_INSECURE_HTTP" in run.stderr
    for url in ("http://portal.example.com", "http://127.0.0.1:8000", "HTTP://portal.example.com"):
        assert main(["show-config", "--portal-url", url, *flags]) == 2
        err = capsys.readouterr().err
        assert "portal_url" in err and "GPUPOOL_ALLOW_INSECURE_HTTP" in err and "https://" in err
    with pytest.raises(ConfigError, match="allow_insecure_http"):
        load_config(env={"GPUPOOL_PORTAL_URL": "http://p", "GPUPOOL_ALLOW_INSECURE_HTTP": "0"}).validate()
    with pytest.raises(ConfigError, match="allow_insecure_http: 'maybe' is not"):
        load_config(env={"GPUPOOL_ALLOW_INSECURE_HTTP": "maybe"})
    # Allowed explicitly: the variable, the flag, the config file; https:// needs nothing.
    assert load_config(env={"GPUPOOL_PORTAL_URL": "http://p", "GPUPOOL_ALLOW_INSECURE_HTTP": "1"}).validate()
    config_file = tmp_path / "agent.toml"
    config_file.write_text('portal_url = "http://p"\nallow_insecure_http = true\n')
    assert load_config(env={}, config_file=config_file).validate().allow_insecure_http is True
    assert main(["show-config", "--portal-url", "http://p", "--allow-insecure-http"]) == 0
    assert json.loads(capsys.readouterr().out)["allow_insecure_http"] is True
    assert AgentConfig(portal_url="https://portal.example.com").validate().allow_insecure_http is False


def test_the_simulated_fleet_allows_plain_http_on_loopback_only(tmp_path: Path) -> None:
    from nodes.agent.fleet import node_config

    node = {"hostname": "sim-001"}
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert node_config(node, portal_url=url, state_root=tmp_path).allow_insecure_http
    with pytest.raises(ConfigError, match="allow_insecure_http"):
        node_config(node, portal_url="http://agent-web:8000", state_root=tmp_path)
    # The compose fleet reaches agent-web over its private network: allowed there explicitly.
    assert node_config(
        node, portal_url="http://agent-web:8000", state_root=tmp_path, allow_insecure_http=True
    )


def test_a_fleet_refuses_plain_http_off_loopback_with_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("GPUPOOL_ALLOW_INSECURE_HTTP", raising=False)
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(
        json.dumps({"portal_url": "http://agent-web:8000", "nodes": [{"hostname": "sim-1"}]})
    )
    argv = ["fleet", "--fleet-file", str(fleet_file), "--state-root", str(tmp_path / "agents")]
    assert main(argv) == 2
    assert "GPUPOOL_ALLOW_INSECURE_HTTP" in capsys.readouterr().err


def test_published_ports_listen_on_a_configured_ip_address(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"GPUPOOL_PORTAL_URL": "https://portal.example"}
    config = load_config(env={**base, "GPUPOOL_PUBLISH_ADDRESS": "10.0.0.7"}).validate()
    assert config.runtime_options()["publish_address"] == "10.0.0.7"
    config = load_config(cli={"tcp_publish_address": "0.0.0.0"}, env=base).validate()
    assert (config.publish_address, config.tcp_publish_address) == ("127.0.0.1", "0.0.0.0")
    for name in ("publish_address", "tcp_publish_address"):
        for bad in ("gpu-1.example", "10.0.0.7:80", "-h"):
            with pytest.raises(ConfigError, match=f"{name} must be an IP address"):
                load_config(cli={name: bad}, env=base).validate()


def test_the_ssh_recheck_period_is_a_setting_with_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_config(env={"GPUPOOL_SSH_RECHECK_S": "2.5"}).ssh_recheck_s == 2.5
    assert AgentConfig(portal_url="https://p").validate().ssh_recheck_s == 15.0
    assert main(["show-config", "--portal-url", "https://p", "--ssh-recheck", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["ssh_recheck_s"] == 0.5
    for bad in ("0", "-1", "3601"):
        assert main(["show-config", "--portal-url", "https://p", "--ssh-recheck", bad]) == 2
        assert "ssh_recheck_s" in capsys.readouterr().err
