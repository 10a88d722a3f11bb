"""No uvicorn of the deployment believes forwarded headers from anyone: the client's address is the
portal's decision (``TRUSTED_PROXIES``, ``portal.ratelimit.client_ip``), which the sign-in limits
and the audit log rely on."""

from __future__ import annotations

import yaml

from tests.deploy.test_keepalive import ROOT, uvicorn_commands


def test_every_uvicorn_ignores_forwarded_headers():
    commands = uvicorn_commands()
    assert len(commands) == 6
    for where, args in commands.items():
        assert "--no-proxy-headers" in args, where
        assert not any(a.startswith(("--proxy-headers", "--forwarded-allow-ips")) for a in args), where


def test_kubernetes_names_the_proxies_it_trusts():
    config = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy/k8s/config.yaml").read_text())
        if d["metadata"]["name"] == "gpupool-config"
    )
    assert config["data"]["TRUSTED_PROXIES"]
