"""deploy/systemd/gpupool-agent.service: systemd accepts it and it keeps its hardening."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy.helpers import DEPLOY, agent_settings

UNIT = DEPLOY / "systemd" / "gpupool-agent.service"


def parse() -> dict[str, dict[str, str]]:
    """Sections of the unit: key -> value; a key given several times (Environment=) keeps every
    value, space-separated, as systemd reads them."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, line
        key, sep, value = line.partition("=")
        assert sep, line
        current[key] = f"{current[key]} {value}".strip() if key in current else value
    return sections


def test_systemd_analyze_verify_is_clean(tmp_path):
    binary = shutil.which("systemd-analyze")
    assert binary, "systemd-analyze is missing: run scripts/install-system-deps (Debian package systemd)"
    # verify checks that ExecStart exists: point it at this checkout's gpupool-agent.
    agent = Path(sys.executable).parent / "gpupool-agent"
    assert agent.is_file()
    text = UNIT.read_text().replace("ExecStart=/opt/gpupool/venv/bin/gpupool-agent", f"ExecStart={agent}")
    assert text != UNIT.read_text()
    (tmp_path / "gpupool-agent.service").write_text(text)
    result = subprocess.run(
        [binary, "verify", str(tmp_path / "gpupool-agent.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (result.stdout + result.stderr).strip()
    # Unknown keys are only warnings to systemd: any output fails the check.
    assert result.returncode == 0 and not output, output


def test_systemd_analyze_reports_an_unknown_key(tmp_path):
    agent = Path(sys.executable).parent / "gpupool-agent"
    text = UNIT.read_text().replace("ExecStart=/opt/gpupool/venv/bin/gpupool-agent", f"ExecStart={agent}")
    (tmp_path / "gpupool-agent.service").write_text(text.replace("NoNewPrivileges=", "NoNewPrivilege="))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "gpupool-agent.service")], capture_output=True, text=True
    )
    assert "Unknown key 'NoNewPrivilege'" in result.stdout + result.stderr


def test_hardening_restart_and_environment():
    service = parse()["Service"]
    assert service["ProtectSystem"] == "strict"
    assert service["StateDirectory"] == "gpupool-agent"
    assert service["NoNewPrivileges"] == "true"
    assert service["Restart"] in ("always", "on-failure") and float(service["RestartSec"]) > 0
    assert service["RestartPreventExitStatus"] == "2"  # nodes.agent.cli.EXIT_CONFIG
    assert service["EnvironmentFile"] == "/etc/gpupool/agent.env"
    assert service["ExecStart"].split()[0].endswith("/gpupool-agent")
    for key in (
        "ProtectHome",
        "PrivateTmp",
        "ProtectKernelModules",
        "ProtectKernelTunables",
        "ProtectControlGroups",
    ):
        assert service[key] == "true", key
    # Only what the docker gangs need: their firewall rules (nodes/agent/runtimes/gang_firewall.py)
    # and, with a gang network, the rules set inside each member's network namespace
    # (nodes/agent/runtimes/gang_network.py); no other namespace may be made.
    assert service["CapabilityBoundingSet"] == "CAP_NET_ADMIN CAP_SYS_ADMIN"
    assert service["RestrictNamespaces"] == "net"
    assert service["ReadWritePaths"] == "/run/xtables.lock"
    # The state directory systemd makes is where the agent keeps its credential and buffer.
    settings = dict(line.split("=", 1) for line in service.get("Environment", "").split())
    assert settings["GPUPOOL_STATE_DIR"] == "/var/lib/" + service["StateDirectory"]
    assert "GPUPOOL_STATE_DIR" in agent_settings()
    assert parse()["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in parse()["Unit"]["After"]
