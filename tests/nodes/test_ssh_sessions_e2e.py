# ruff: noqa: F811  (fixtures imported from the other end-to-end modules)
"""Open SSH sessions follow authority, end to end: a real ``ssh`` client through the real agent's
endpoint (``tests.nodes.test_ssh_e2e``'s agent, portal and client), with the agent's recheck every
half second (``GPUPOOL_SSH_RECHECK_S``).

- A deleted key, a removed member and a deactivated member lose their open sessions; a key still
  allowed keeps its session through the same rechecks (the positive control).
- A stopped workload's sessions close at once.
- A client that goes (killed, no goodbye) leaves no process behind: the docker runtime's exec and
  the subprocess runtime's process group are killed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from portal.actors import Actor
from portal.models import Membership, Role
from portal.services.members import membership_remove
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.ssh_keys import ssh_key_create
from scheduling.services.submission import workload_submit
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    running_portal,
    wait_for,
)
from tests.nodes.test_ssh_e2e import (  # noqa: F401  (fixtures and helpers)
    Gpu,
    Login,
    Person,
    _instance,
    _state,
    adopted_containers,
    logins,
    ssh_ready,
    start_ssh_agent,
)

pytestmark = pytest.mark.slow

RECHECK = {"GPUPOOL_SSH_RECHECK_S": "0.5"}


class Session:
    """A long ``ssh`` session (the command prints ``ready`` then waits), as ``Login.run`` builds it."""

    def __init__(self, login: Login, workload: Workload, person: Person, command: str) -> None:
        ssh = login.access(workload)["ssh"]
        assert ssh is not None
        known_hosts = login.tmp_path / f"known_hosts_{workload.pk}"
        known_hosts.write_text(ssh["known_hosts"] + "\n")
        argv = [
            "ssh", "-i", str(person.key_file), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-T",
            *shlex.split(ssh["command"])[1:], f"echo ready; {command}",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", (line, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def ended_within(self, timeout: float) -> float:
        """Seconds until the client ended (its connection closed by the endpoint)."""
        start = time.monotonic()
        self.proc.wait(timeout=timeout)
        return time.monotonic() - start

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _container_runs(docker_engine, workload: Workload, marker: str) -> bool:
    processes = docker_engine.containers.get(f"gpupool-{workload.pk}").top().get("Processes") or []
    return any(marker in " ".join(p) for p in processes)


def _host_runs(marker: str) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return any(line.strip() == f"sleep {marker}" for line in ps.splitlines())


def test_open_docker_sessions_end_with_the_authority_that_opened_them(
    start_ssh_agent, logins, adopted_containers, docker_engine, tmp_path
):
    agent = start_ssh_agent("ssh-recheck", "docker", RECHECK)
    node = ssh_ready(agent)
    model = Gpu.objects.filter(node=node).first().model.name
    tenant = tenant_create(slug="sshr", name="SSH R", owner_email="o@sshr.test", actor=Actor.system())
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    _, token = api_token_create(tenant=tenant, name="cli", scopes=["read", "write"], actor=Actor(user=owner))
    login = logins(token)
    people = {name: Person(tmp_path, name) for name in ("owner", "own", "m1", "m2")}
    r = login.api.post("/api/v1/ssh-keys/", json={"name": "laptop", "public_key": people["owner"].public})
    assert r.status_code == 201, r.text
    owner_key_id = r.json()["id"]
    members = []
    for name in ("m1", "m2"):
        user = type(owner).objects.create_user(email=f"{name}@sshr.test")
        members.append(Membership.objects.create(tenant=tenant, user=user, role=Role.MEMBER))
        ssh_key_create(user=user, name="k", public_key=people[name].public, actor=Actor(user=user))
    a = _instance(tenant, model, people["own"], image=TEST_IMAGE)
    b = _instance(tenant, model, people["own"], image=TEST_IMAGE)
    adopted_containers(a, {})
    adopted_containers(b, {})
    assert scheduling_cycle_run().ran
    wait_for(lambda: _state(a) == S.RUNNING and _state(b) == S.RUNNING, what="both to run")

    sessions: list[Session] = []
    try:
        # The owner's saved key and the workload's own key, side by side into A.
        owners = Session(login, a, people["owner"], "sleep 401")
        own = Session(login, a, people["own"], "sleep 402")
        sessions += [owners, own]
        assert _container_runs(docker_engine, a, "sleep 401")
        assert login.api.delete(f"/api/v1/ssh-keys/{owner_key_id}/").status_code == 204
        took = owners.ended_within(10)
        assert owners.proc.returncode == 255 and "access to workload" in owners.proc.stderr.read()
        print(f"deleted key: session closed {took:.2f} s after the key's deletion (recheck 0.5 s)")
        # Its exec went with it; the other key's session stays through several rechecks.
        wait_for(lambda: not _container_runs(docker_engine, a, "sleep 401"), 10, "the exec to end")
        time.sleep(1.5)
        assert own.alive() and _container_runs(docker_engine, a, "sleep 402")

        # A member removed, and a member deactivated: their sessions into B end.
        removed = Session(login, b, people["m1"], "sleep 403")
        deactivated = Session(login, b, people["m2"], "sleep 404")
        sessions += [removed, deactivated]
        membership_remove(membership=members[0], actor=Actor(user=owner))
        took = removed.ended_within(10)
        print(f"removed member: session closed {took:.2f} s after the removal")
        assert deactivated.alive()
        type(owner).objects.filter(pk=members[1].user_id).update(is_active=False)
        took = deactivated.ended_within(10)
        print(f"deactivated member: session closed {took:.2f} s after the deactivation")
        wait_for(
            lambda: (
                not _container_runs(docker_engine, b, "sleep 403")
                and not _container_runs(docker_engine, b, "sleep 404")
            ),
            10,
            "the execs to end",
        )

        # A client that goes without a word: its exec is killed.
        gone = Session(login, b, people["own"], "sleep 405")
        sessions.append(gone)
        assert _container_runs(docker_engine, b, "sleep 405")
        gone.proc.send_signal(signal.SIGKILL)
        gone.proc.wait()
        wait_for(lambda: not _container_runs(docker_engine, b, "sleep 405"), 10, "the exec to end")

        # Stopping A closes its open session at once (the container still waits out its grace).
        started = time.monotonic()
        assert login.api.post(f"/api/v1/instances/{a.pk}/stop/").status_code in (200, 202)
        took = own.ended_within(10)
        print(f"stop: session closed {time.monotonic() - started:.2f} s after the stop request")
        assert own.proc.returncode == 255
    finally:
        for session in sessions:
            session.close()


def test_a_process_session_ends_with_its_client_and_with_its_key(start_ssh_agent, logins, tmp_path):
    work_dir = tempfile.mkdtemp(prefix="gpupool-sshr-")
    os.chmod(work_dir, 0o755)
    user = "nobody" if os.geteuid() == 0 else ""
    env = {
        "GPUPOOL_SINGLE_TENANT": "1",
        "GPUPOOL_PROCESS_USER": user,
        "GPUPOOL_PROCESS_WORK_DIR": work_dir,
        **RECHECK,
    }
    sessions: list[Session] = []
    try:
        agent = start_ssh_agent("ssh-recheck-p", "subprocess", env)
        node = ssh_ready(agent)
        model = Gpu.objects.filter(node=node).first().model.name
        tenant = tenant_create(slug="sshrp", name="SSH RP", owner_email="o@sshrp.test", actor=Actor.system())
        owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
        _, token = api_token_create(
            tenant=tenant, name="cli", scopes=["read", "write"], actor=Actor(user=owner)
        )
        login = logins(token)
        person = Person(tmp_path, "p")
        key = ssh_key_create(user=owner, name="laptop", public_key=person.public, actor=Actor(user=owner))
        w = workload_submit(
            tenant=tenant,
            kind="instance",
            spec={"gpu_models": [model], "image": "ghcr.io/acme/host:1", "command": ["/bin/sleep", "3600"]},
            actor=Actor.system(),
        )
        assert scheduling_cycle_run().ran
        wait_for(lambda: _state(w) == S.RUNNING, what="the process instance to run")

        # Markers unique to this run: the host's process table is shared with everything else.
        gone_marker, kept_marker = (f"{4000 + uuid.uuid4().int % 1000}.{n}" for n in (1, 2))
        gone = Session(login, w, person, f"sleep {gone_marker}")
        sessions.append(gone)
        assert _host_runs(gone_marker)
        gone.proc.send_signal(signal.SIGKILL)
        gone.proc.wait()
        wait_for(lambda: not _host_runs(gone_marker), 10, "the session's process to end")

        kept = Session(login, w, person, f"sleep {kept_marker}")
        sessions.append(kept)
        time.sleep(1.5)  # rechecks pass while the key is allowed
        assert kept.alive() and _host_runs(kept_marker)
        assert login.api.delete(f"/api/v1/ssh-keys/{key.pk}/").status_code == 204
        took = kept.ended_within(10)
        print(f"process runtime, deleted key: session closed {took:.2f} s after the deletion")
        wait_for(lambda: not _host_runs(kept_marker), 10, "the session's process to end")
    finally:
        for session in sessions:
            session.close()
        shutil.rmtree(work_dir, ignore_errors=True)
