"""Every way gpupool starts its web tier keeps idle connections longer than its clients do: the
agents (nodes.agent.client.KEEPALIVE_S) and, in Kubernetes, ingress-nginx's upstream keep-alive
(60 s). The side that closes an idle connection must be the one that would reuse it, or a request
can be sent just as the server closes the connection (a failed heartbeat, or a 502 from the
ingress for a POST it will not retry)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from nodes.agent.agent import DEFAULT_HEARTBEAT_INTERVAL_S
from nodes.agent.client import KEEPALIVE_S

ROOT = Path(__file__).resolve().parents[2]
INGRESS_UPSTREAM_KEEPALIVE_S = 60


def keep_alive(args: list[str]) -> int | None:
    for i, arg in enumerate(args):
        if arg.startswith("--timeout-keep-alive="):
            return int(arg.split("=", 1)[1])
        if arg == "--timeout-keep-alive":
            return int(args[i + 1])
    return None


def uvicorn_commands() -> dict[str, list[str]]:
    found = {}
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    # web, and agent-web: the agents' own ingress, where their connections go.
    for name in ("web", "agent-web"):
        found[f"compose {name}"] = compose["services"][name]["command"]
        for doc in yaml.safe_load_all((ROOT / f"deploy/k8s/{name}.yaml").read_text()):
            if doc and doc.get("kind") == "Deployment":
                found[f"k8s {name}"] = doc["spec"]["template"]["spec"]["containers"][0]["command"]
    cmd = re.search(r"^CMD (\[.*\])$", (ROOT / "deploy/Dockerfile").read_text(), re.M)
    found["Dockerfile"] = yaml.safe_load(cmd.group(1))
    procfile = dict(line.split(": ", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line)
    found["Procfile web"] = shlex.split(procfile["web"])
    return found


def test_the_web_tier_outlasts_its_clients_idle_connections():
    commands = uvicorn_commands()
    assert len(commands) == 6
    for where, args in commands.items():
        assert "uvicorn" in " ".join(args), where
        seconds = keep_alive(args)
        assert seconds is not None, f"{where}: no --timeout-keep-alive (uvicorn's default is 5 s)"
        assert seconds > KEEPALIVE_S and seconds > INGRESS_UPSTREAM_KEEPALIVE_S, where
    assert KEEPALIVE_S > DEFAULT_HEARTBEAT_INTERVAL_S  # consecutive heartbeats reuse a connection
