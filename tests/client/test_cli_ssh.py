# ruff: noqa: F811  (fixtures imported from the SSH end-to-end tests)
"""``gpupool ssh`` runs the real OpenSSH client into a job on the real agent's SSH endpoint (the
subprocess runtime), trusting only the host key the portal gives; the portal on uvicorn in a
thread, the agent a process, the CLI a process of its own as a user would run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from nodes.models import Gpu
from portal.actors import Actor
from portal.models import Membership, Role
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.ssh_keys import ssh_key_create
from scheduling.services.submission import workload_submit
from tests.client.conftest import ROOT
from tests.nodes.test_ssh_e2e import (  # noqa: F401  (fixtures)
    Person,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    running_portal,
    ssh_ready,
    start_ssh_agent,
    wait_for,
)

pytestmark = pytest.mark.slow


def gpupool(*args: str, url: str, token: str, config: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": config, "PYTHONPATH": str(ROOT / "client" / "src"),
           "GPUPOOL_URL": url, "GPUPOOL_TOKEN": token, "GPUPOOL_CONFIG_DIR": config}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "gpupool", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=90)  # fmt: skip


def test_gpupool_ssh_runs_a_command_in_the_job(start_ssh_agent, running_portal, tmp_path):
    work_dir = tempfile.mkdtemp(prefix="gpupool-cli-ssh-")
    os.chmod(work_dir, 0o755)
    user = "nobody" if os.geteuid() == 0 else ""
    env = {"GPUPOOL_SINGLE_TENANT": "1", "GPUPOOL_PROCESS_USER": user, "GPUPOOL_PROCESS_WORK_DIR": work_dir}
    try:
        node = ssh_ready(start_ssh_agent("cli-ssh", "subprocess", env))
        model = Gpu.objects.filter(node=node).first().model.name
        tenant = tenant_create(
            slug="clissh", name="CLI SSH", owner_email="o@clissh.test", actor=Actor.system()
        )
        owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
        _, token = api_token_create(tenant=tenant, name="cli", scopes=["read"], actor=Actor(user=owner))
        person = Person(tmp_path, "p")
        ssh_key_create(user=owner, name="laptop", public_key=person.public, actor=Actor(user=owner))
        spec = {"gpu_models": [model], "image": "ghcr.io/acme/host:1", "command": ["/bin/sleep", "3600"],
                "env": {"GREETING": "hi from the job"}}  # fmt: skip
        w = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
        assert scheduling_cycle_run().ran
        wait_for(lambda: Workload.objects.get(pk=w.pk).state == S.RUNNING, what="the job to run")
        config = str(tmp_path / "config")
        os.makedirs(config, mode=0o700)
        common = {"url": running_portal.url, "token": token, "config": config}
        ran = gpupool("ssh", str(w.pk), "-i", str(person.key_file), "-o", "BatchMode=yes", "--",
                      'echo "$GREETING"; pwd', **common)  # fmt: skip
        assert ran.returncode == 0, ran
        assert ran.stdout.splitlines() == ["hi from the job", f"{work_dir}/{w.pk}/home"], ran
        # Another key is refused, and ssh's failure is the command's exit status.
        stranger = Person(tmp_path, "stranger")
        refused = gpupool("ssh", str(w.pk), "-i", str(stranger.key_file), "-o", "BatchMode=yes", "--", "true",
                          **common)  # fmt: skip
        assert refused.returncode == 255, refused
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
