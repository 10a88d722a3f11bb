# ruff: noqa: F811  (fixtures imported from test_e2e_agent)
"""End to end: a real OpenSSH client logs in to instances through the real agent's SSH endpoint.

The real portal (uvicorn in a thread, ``tests.nodes.test_e2e_agent``'s fixtures), a real agent
process (``python -m nodes.agent.cli run --ssh-listen 127.0.0.1:0``) with the docker runtime on the
real Docker Engine or the subprocess runtime, and ``ssh`` from openssh-client with real keys. The
command pasted is the one the API's ``access.ssh`` gives, and the host key is checked against its
``known_hosts`` line (``StrictHostKeyChecking=yes``).

This machine has no NVIDIA container runtime, so a container asking for the node's (simulated)
GPUs cannot start: each docker workload's container is made beforehand without GPUs under the name
the runtime gives it (``gpupool-<id>``), and the agent's start, idempotent by that name, adopts it.
Everything after that (placement, the start command, RUNNING, login) is the real path.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.types import WorkloadSpec
from nodes.models import Gpu, Node, NodeState
from portal.actors import Actor
from portal.models import Membership, Role
from portal.services.members import membership_remove
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import SshKey, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.ssh_keys import ssh_key_create
from scheduling.services.submission import workload_submit
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (the real engine)
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    ROOT,
    AgentProcess,
    Portal,
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)
from tests.ssh_keys import key_pair

pytestmark = pytest.mark.slow


class SshAgent(AgentProcess):
    """The agent program with a runtime of choice and its SSH endpoint on a free loopback port."""

    def __init__(self, portal: Portal, state_dir: Path, hostname: str, runtime: str, env: dict[str, str]):
        super().__init__(portal, state_dir, hostname, gpus=2)
        self.runtime = runtime
        self.extra_env = env

    def start(self) -> SshAgent:
        assert self.proc is None
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUPOOL_ALLOW_INSECURE_HTTP": "1", **self.extra_env}
        env.pop("DJANGO_SETTINGS_MODULE", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(self.config),
             "--portal-url", self.portal.url, "--bootstrap-token", self.token,
             "--state-dir", str(self.state_dir), "--collector", "simulated", "--runtime", self.runtime,
             "--hostname", self.hostname, "--region", "e2e-1", "--advertise-address", "127.0.0.1",
             "--ssh-listen", "127.0.0.1:0",
             "--sim-gpus", json.dumps([{"model": H100, "count": self.gpus}]),
             "--sample-interval", "0.1", "--heartbeat-interval", "0.5",
             "--commands-wait", "2", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self


@pytest.fixture
def start_ssh_agent(running_portal: Portal, tmp_path: Path) -> Iterator[Callable[..., SshAgent]]:
    agents: list[SshAgent] = []

    def start(hostname: str, runtime: str, env: dict[str, str] | None = None) -> SshAgent:
        agent = SshAgent(running_portal, tmp_path / hostname, hostname, runtime, env or {}).start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.kill()


def ssh_ready(agent: SshAgent) -> Node:
    node = registered(agent)
    # Work goes to this node only (the module's database keeps the other tests' nodes).
    Node.objects.exclude(pk=node.pk).update(state=NodeState.CORDONED)
    return wait_for(
        lambda: Node.objects.filter(pk=node.pk, ssh_port__isnull=False).first(),
        what=f"{agent.hostname} to announce its SSH endpoint",
    )


class Person:
    """A key pair on disk, as a person's laptop holds it."""

    def __init__(self, directory: Path, name: str) -> None:
        private, self.public = key_pair(comment=f"{name}@laptop")
        self.key_file = directory / f"{name}_ed25519"
        self.key_file.write_bytes(private)
        self.key_file.chmod(0o600)


class Login:
    """``ssh`` as the API says to run it, with the API's known_hosts line."""

    def __init__(self, portal: Portal, token: str, tmp_path: Path) -> None:
        self.api = httpx.Client(base_url=portal.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        self.tmp_path = tmp_path

    def access(self, workload: Workload) -> dict:
        r = self.api.get(f"/api/v1/{workload.kind}s/{workload.pk}/")
        assert r.status_code == 200, r.text
        return r.json()["access"]

    def run(
        self, workload: Workload, person: Person, command: str, *, tty: bool = False, stdin: str = ""
    ) -> subprocess.CompletedProcess[str]:
        ssh = self.access(workload)["ssh"]
        assert ssh is not None, self.access(workload)
        known_hosts = self.tmp_path / f"known_hosts_{workload.pk}"
        known_hosts.write_text(ssh["known_hosts"] + "\n")
        pasted = shlex.split(ssh["command"])
        assert pasted[0] == "ssh"
        argv = [
            "ssh", "-i", str(person.key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
            *(["-tt"] if tty else ["-T"]), *pasted[1:], command,
        ]  # fmt: skip
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)


@pytest.fixture
def logins(running_portal: Portal, tmp_path: Path) -> Iterator[Callable[[str], Login]]:
    made: list[Login] = []

    def make(token: str) -> Login:
        made.append(Login(running_portal, token, tmp_path))
        return made[-1]

    yield make
    for login in made:
        login.api.close()


def refused(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == 255 and "Permission denied" in result.stderr


@pytest.fixture
def adopted_containers(docker_engine, tmp_path: Path) -> Iterator[Callable[[Workload, dict[str, str]], None]]:
    """``make(workload, env)``: the workload's container, made without GPUs (see the module's note)."""
    runtime = DockerRuntime(tmp_path / "test-runtime", node_gpus=2)
    made: list[str] = []

    def make(workload: Workload, env: dict[str, str]) -> None:
        wid = str(workload.pk)
        runtime.start(
            WorkloadSpec(
                workload_id=wid, image=TEST_IMAGE, command=["sleep", "3600"], env=env,
                cpu_millicores=500, ram_mib=256,
            )
        )  # fmt: skip
        made.append(wid)

    yield make
    for wid in made:
        runtime.forget(wid)
    runtime.close()


def _instance(tenant, model: str, person: Person, **spec) -> Workload:
    return workload_submit(
        tenant=tenant,
        kind="instance",
        spec={"gpu_models": [model], "ssh_public_key": person.public, **spec},
        actor=Actor.system(),
    )


def _state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def test_ssh_into_docker_workloads_with_the_teams_keys_and_nothing_else(
    start_ssh_agent, logins, adopted_containers, tmp_path
):
    agent = start_ssh_agent("ssh-docker", "docker")
    node = ssh_ready(agent)
    model = Gpu.objects.filter(node=node).first().model.name
    tenant = tenant_create(slug="sshd", name="SSH", owner_email="o@sshd.test", actor=Actor.system())
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    _, token = api_token_create(tenant=tenant, name="cli", scopes=["read", "write"], actor=Actor(user=owner))
    login = logins(token)
    people = {name: Person(tmp_path, name) for name in ("owner", "a", "b", "member", "stranger", "nobody")}

    # The owner saves a key through the API (real HTTP); A and B are launched with keys of their own.
    r = login.api.post("/api/v1/ssh-keys/", json={"name": "laptop", "public_key": people["owner"].public})
    assert r.status_code == 201, r.text
    owner_key_id = r.json()["id"]
    a = _instance(tenant, model, people["a"], image=TEST_IMAGE, env={"GREETING": "hello from A"})
    b = _instance(tenant, model, people["b"], image=TEST_IMAGE)
    assert login.access(a)["ssh"] is None  # not running yet: no command, a reason
    adopted_containers(a, {"GREETING": "hello from A"})
    adopted_containers(b, {})
    assert scheduling_cycle_run().ran
    wait_for(lambda: _state(a) == S.RUNNING and _state(b) == S.RUNNING, what="both to run")

    # The command of access.ssh, with a saved key: a command runs inside A, its output, its stderr
    # and its exit status come back; stdin reaches it; a terminal when asked for.
    ran = login.run(
        a, people["owner"], 'echo "$GREETING"; echo "$GPUPOOL_WORKLOAD_ID"; echo oops >&2; exit 7'
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, f"hello from A\n{a.pk}\n", "oops\n"), ran
    assert login.run(a, people["owner"], "cat", stdin="piped in\n").stdout == "piped in\n"
    tty = login.run(a, people["owner"], "tty; echo $TERM", tty=True)
    assert tty.returncode == 0 and tty.stdout.startswith("/dev/pts/"), tty
    # Inside the container: its hardening holds for the session (no capabilities at all).
    caps = login.run(a, people["owner"], "grep CapEff /proc/self/status").stdout
    assert caps.split() == ["CapEff:", "0000000000000000"], caps

    # Each workload's own key opens it and not the other.
    assert login.run(a, people["a"], "echo in-a").stdout == "in-a\n"
    assert login.run(b, people["b"], "echo in-b").stdout == "in-b\n"
    assert refused(login.run(a, people["b"], "true"))
    assert refused(login.run(b, people["a"], "true"))
    # A key nobody saved, and another team's owner's saved key: refused.
    assert refused(login.run(a, people["nobody"], "true"))
    other = tenant_create(slug="other-ssh", name="Other", owner_email="o@other.test", actor=Actor.system())
    stranger = Membership.objects.get(tenant=other, role=Role.OWNER).user
    ssh_key_create(user=stranger, name="k", public_key=people["stranger"].public, actor=Actor(user=stranger))
    assert refused(login.run(a, people["stranger"], "true"))

    # A member's key works until the member is removed: refused from the next login on.
    member = Membership.objects.create(
        tenant=tenant, user=type(owner).objects.create_user(email="m@sshd.test"), role=Role.MEMBER
    )
    ssh_key_create(
        user=member.user, name="k", public_key=people["member"].public, actor=Actor(user=member.user)
    )
    assert login.run(b, people["member"], "echo member").stdout == "member\n"
    membership_remove(membership=member, actor=Actor(user=owner))
    assert refused(login.run(b, people["member"], "true"))

    # A deleted key (through the API) is refused from the next login on.
    assert login.api.delete(f"/api/v1/ssh-keys/{owner_key_id}/").status_code == 204
    assert not SshKey.objects.filter(pk=owner_key_id).exists()
    assert refused(login.run(a, people["owner"], "true"))

    # An instance being stopped opens to nobody, its own key included (the container itself is
    # still there: busybox's sleep waits out the stop's grace period).
    r = login.api.post(f"/api/v1/instances/{a.pk}/stop/")
    assert r.status_code in (200, 202), r.text
    assert _state(a) == S.STOPPING
    assert login.access(a)["ssh"] is None
    ssh = subprocess.run(
        ["ssh", "-i", str(people["a"].key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
         "-p", str(Node.objects.get(pk=node.pk).ssh_port), f"{a.pk}@127.0.0.1", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused(ssh), ssh


def test_ssh_into_a_process_workload_runs_as_its_user_in_its_directory_with_its_env(
    start_ssh_agent, logins, tmp_path
):
    # The workloads' directories live outside pytest's (0700) tree, where "nobody" can enter.
    work_dir = tempfile.mkdtemp(prefix="gpupool-ssh-")
    os.chmod(work_dir, 0o755)
    user = "nobody" if os.geteuid() == 0 else ""
    env = {"GPUPOOL_SINGLE_TENANT": "1", "GPUPOOL_PROCESS_USER": user, "GPUPOOL_PROCESS_WORK_DIR": work_dir}
    try:
        agent = start_ssh_agent("ssh-process", "subprocess", env)
        node = ssh_ready(agent)
        model = Gpu.objects.filter(node=node).first().model.name
        tenant = tenant_create(slug="sshp", name="SSH P", owner_email="o@sshp.test", actor=Actor.system())
        owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
        _, token = api_token_create(tenant=tenant, name="cli", scopes=["read"], actor=Actor(user=owner))
        login = logins(token)
        person = Person(tmp_path, "p")
        # A job (an instance has no command, and the process runtime runs one); its owner's saved key.
        ssh_key_create(user=owner, name="laptop", public_key=person.public, actor=Actor(user=owner))
        w = workload_submit(
            tenant=tenant,
            kind="job",
            spec={
                "gpu_models": [model],
                "image": "ghcr.io/acme/host:1",
                "command": ["/bin/sleep", "3600"],
                "env": {"GREETING": "hi from the host"},
            },
            actor=Actor.system(),
        )
        assert scheduling_cycle_run().ran
        wait_for(lambda: _state(w) == S.RUNNING, what="the process workload to run")
        ran = login.run(
            w, person, 'pwd; echo "$GREETING"; id -un; echo "$HOME"; echo "$GPUPOOL_BOOTSTRAP_TOKEN"'
        )
        home = f"{work_dir}/{w.pk}/home"
        expected_user = user or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        assert ran.returncode == 0, ran
        assert ran.stdout.splitlines() == [home, "hi from the host", expected_user, home, ""], ran
        tty = login.run(w, person, "tty", tty=True)
        assert tty.returncode == 0 and tty.stdout.startswith("/dev/pts/"), tty
        assert refused(login.run(w, Person(tmp_path, "other"), "true"))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
