"""The agent's ``upgrades`` table: name -> argv, from the config file or ``GPUPOOL_UPGRADES``; names
and commands are checked when the agent starts (a bad entry is a configuration error naming it). And
the commands that use it, on a running agent: ``upgrade`` (configured names only, never while work
runs, killed at its timeout), ``gpu_check`` and ``undrain``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.agent.agent import Agent
from nodes.agent.config import ConfigError, load_config
from tests.agent.conftest import wait_for

BASE = {"GPUPOOL_PORTAL_URL": "https://portal.example"}


def test_upgrades_come_from_the_config_file_or_the_environment(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text('[upgrades]\ndriver-560 = ["/usr/local/sbin/upgrade-driver", "560.35.03"]\n')
    config = load_config(env=BASE, config_file=config_file).validate()
    assert config.upgrades == {"driver-560": ["/usr/local/sbin/upgrade-driver", "560.35.03"]}
    env = {**BASE, "GPUPOOL_UPGRADES": json.dumps({"fw.1": ["/opt/fw/flash"]})}
    assert load_config(env=env).validate().upgrades == {"fw.1": ["/opt/fw/flash"]}
    assert load_config(env=BASE).validate().upgrades == {}


@pytest.mark.parametrize(
    "upgrades, names",
    [
        ({"driver 560": ["/bin/true"]}, "'driver 560'"),
        ({"-x": ["/bin/true"]}, "'-x'"),
        ({"ok": ["upgrade-driver"]}, "upgrades.ok"),  # not an absolute path: no PATH search
        ({"ok": []}, "upgrades.ok"),
        ({"ok": "/bin/true --all"}, "upgrades.ok"),  # a string is not an argv
        ({"ok": ["/bin/true", 3]}, "upgrades.ok"),
    ],
)
def test_a_bad_upgrade_entry_is_a_configuration_error(upgrades, names) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(env={**BASE, "GPUPOOL_UPGRADES": json.dumps(upgrades)}).validate()
    assert names in str(refused.value)


def test_the_agent_runs_only_configured_upgrades_on_an_idle_node_and_undrain_reopens_it(
    portal, make_config, run_agent, tmp_path: Path
) -> None:
    marker = tmp_path / "upgraded"
    upgrades = {
        "ok": ["/bin/sh", "-c", f'echo "$GPUPOOL_UPGRADE" > {marker}; echo done'],
        "slow": ["/bin/sh", "-c", "sleep 30"],
    }
    agent = Agent(make_config(upgrades=upgrades))
    thread = run_agent(agent)
    wait_for(lambda: portal.seqs(1), what="registration")
    uuid = portal.nodes[1]["register"]["gpus"][0]["uuid"]
    start = {"workload_id": "42", "image": "x", "gpu_uuids": [uuid], "env": {}, "command": []}
    portal.queue_command(1, {"id": "c-start", "kind": "start_workload", "payload": start})
    wait_for(lambda: "succeeded" in portal.reports_for("c-start"), what="the start")

    def run(command_id: str, kind: str, payload: dict) -> tuple[str, dict, str]:
        portal.queue_command(1, {"id": command_id, "kind": kind, "payload": payload})
        wait_for(lambda: {"succeeded", "failed"} & set(portal.reports_for(command_id)), what=command_id)
        return next((s, r, m) for cid, s, r, m in portal.reports if cid == command_id and s != "accepted")

    status, _, message = run("c-busy", "upgrade", {"upgrade": "ok", "timeout_s": 10})
    assert status == "failed" and message == "workloads 42 still run here; drain the node first"
    assert not marker.exists()
    run("c-stop", "stop_workload", {"workload_id": "42", "grace_s": 0.1})
    run("c-drain", "drain", {})

    status, _, message = run("c-unknown", "upgrade", {"upgrade": "rm-rf", "timeout_s": 10})
    assert status == "failed" and message == "no upgrade 'rm-rf' is configured on this node"
    status, _, message = run("c-slow", "upgrade", {"upgrade": "slow", "timeout_s": 1})
    assert status == "failed" and message == "upgrade slow did not finish within 1 s; killed"
    status, result, _ = run("c-ok", "upgrade", {"upgrade": "ok", "timeout_s": 10})
    assert status == "succeeded" and result["output"] == "done\n" and result["exit_code"] == 0
    assert marker.read_text() == "ok\n"

    status, result, _ = run("c-check", "gpu_check", {})
    assert status == "succeeded" and result["gpus"] == 2
    (agent.state_dir / "faults.json").write_text(json.dumps([{"gpu": 1, "kind": "retired_pages"}]))
    status, _, message = run("c-check-2", "gpu_check", {})
    assert status == "failed" and message.endswith("has page retirement pending")

    status, _, message = run("c-late", "start_workload", {**start, "workload_id": "43"})
    assert status == "failed" and "draining" in message
    assert run("c-undrain", "undrain", {})[0] == "succeeded"
    assert run("c-again", "start_workload", {**start, "workload_id": "44"})[0] == "succeeded"
    thread.stop()
    assert thread.error is None
