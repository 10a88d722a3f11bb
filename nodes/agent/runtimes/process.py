"""Bare-metal workloads: the command runs as a process group on the host.

The host is not a boundary between tenants, so this runtime runs only on a node configured
single-tenant (``single_tenant``, ``GPUPOOL_SINGLE_TENANT=1``): without it the agent does not start,
and no workload starts. It never runs a workload as root: an agent running as root runs them as
``process_user`` (``GPUPOOL_PROCESS_USER``; uid and gid not 0, no supplementary groups but, on AMD
and Intel GPUs, the groups owning their device files) and refuses
to start without one; an agent running as another user runs them as itself.

The argv is executed as given (never through a shell). The environment is exactly: ``PATH`` (and
``LANG`` when set) of the agent, ``HOME``, ``USER`` and ``LOGNAME`` of the workload's user, the
workload's own env byte for byte, and the platform's variables (``CUDA_VISIBLE_DEVICES`` = its GPU
UUIDs on NVIDIA; on AMD ``ROCR_VISIBLE_DEVICES`` = its GPUs' indices in PCI order and
``HIP_VISIBLE_DEVICES``; on Intel ``ZE_AFFINITY_MASK`` with ``ZE_ENABLE_PCI_ID_DEVICE_ORDER=1``,
``GPUPOOL_WORKLOAD_ID``, ``GPUPOOL_PREEMPT_NOTICE_FILE``, ``GPUPOOL_RESIZE_FILE``, the GPU share's); nothing else of
the agent's environment (its bootstrap token) reaches it.

Files: ``<process_work_dir>/<id>/`` (root's, readable) holds the preemption notice the agent
writes; ``<id>/home/`` (the user's, 0700) is the working directory and ``HOME``. A process cannot
be given a mount namespace of its own here, so each volume (its directory under ``volumes_root``,
owned by the workload's user) is linked into the working directory under its mount path with the
slashes made ``_`` (``/workspace``: ``$HOME/workspace``; ``/data/in``: ``$HOME/data_in``), and a
checkpointing job's ``GPUPOOL_CHECKPOINT_DIR`` is the host path of its checkpoint directory. stdout and stderr
go to ``<state dir>/process-logs/<id>.log``, which the workload cannot reach (the state directory is
the agent's alone), so it cannot swap the log for a link to a file the agent would read out. Stop
sends SIGTERM to the group and SIGKILL after the grace period. The image field is ignored (there is
nothing to pull) and CPU and memory limits are not enforced: use the docker runtime where they
matter.

SSH sessions into a workload (``nodes/agent/ssh.py``) start the same way as its command
(``_launch_options``): its user, its home as working directory, exactly its environment (kept in
the agent's private records), a session of their own; they end when the workload ends or stops.

Ports: a process shares the host's network, so the agent cannot publish a port for it. For each
requested port the agent picks a free host port on the address of its protocol (``publish_address``
or ``tcp_publish_address``) and tells the workload: ``GPUPOOL_PORT_<port>`` (the host port to listen
on) and ``GPUPOOL_PORT_<port>_ADDRESS`` (the address to bind). The mapping is reported as the docker
runtime's is; a workload that listens elsewhere is not reachable through the portal. Binding to the
given address is the workload's to do: on a single-tenant host nothing stops it binding more widely.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodes.agent.runtimes import OutputLine, Runtime, RuntimeFailure, read_new_lines, safe_name, volume_env
from nodes.agent.types import EXITED, FAILED, RUNNING, STOPPED, WorkloadHandle, WorkloadSpec, WorkloadStatus
from nodes.agent.volumes import Prepared
from nodes.agent.workload_rules import (
    WorkloadRuleError,
    check_command,
    check_env,
    check_gpu_uuids,
    check_platform_env,
    check_ports,
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PUBLISH_ADDRESS = "127.0.0.1"


def free_port(address: str) -> int:
    """A port nothing listens on at ``address`` now (the kernel's pick); the workload binds it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class ProcessUser:
    """Whom workloads run as; ``switch``: the agent is root and changes to this user for them."""

    name: str
    uid: int
    gid: int
    switch: bool


def process_user(*, single_tenant: bool, user: str) -> ProcessUser:
    """The user workloads run as, or :class:`RuntimeFailure` saying why none may run."""
    if not single_tenant:
        raise RuntimeFailure(
            "the subprocess runtime runs tenants' commands on the host, which isolates nothing: it "
            "runs only on a node configured single-tenant (single_tenant = true or "
            "GPUPOOL_SINGLE_TENANT=1); use the docker runtime otherwise"
        )
    agent_uid = os.geteuid()
    if not user:
        if agent_uid == 0:
            raise RuntimeFailure(
                "the agent runs as root and workloads never do: set process_user "
                "(GPUPOOL_PROCESS_USER) to an unprivileged user"
            )
        entry = pwd.getpwuid(agent_uid)
        return ProcessUser(entry.pw_name, agent_uid, os.getegid(), switch=False)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise RuntimeFailure(f"process_user: there is no user {user!r} on this node") from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise RuntimeFailure(f"process_user: {user!r} is root (uid or gid 0); name an unprivileged user")
    if agent_uid != 0 and entry.pw_uid != agent_uid:
        raise RuntimeFailure(
            f"process_user: the agent runs as uid {agent_uid} and cannot run workloads as {user!r}; "
            "leave process_user unset to run them as the agent's own user"
        )
    return ProcessUser(entry.pw_name, entry.pw_uid, entry.pw_gid, switch=agent_uid == 0)


def _exit_code(returncode: int) -> int:
    """Popen answers -N for a process killed by signal N; shells and docker say 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _alive(pid: int) -> bool:
    """Whether a process that is not our child still runs (a zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class SubprocessRuntime(Runtime):
    name = "subprocess"

    def __init__(
        self,
        state_dir: str | Path,
        *,
        single_tenant: bool = False,
        process_user: str = "",
        process_work_dir: str | Path = "",
        publish_address: str = DEFAULT_PUBLISH_ADDRESS,
        tcp_publish_address: str = "",
        **sharing: str,
    ) -> None:
        super().__init__(state_dir, **sharing)
        self.publish_address = publish_address or DEFAULT_PUBLISH_ADDRESS
        self.tcp_publish_address = tcp_publish_address or self.publish_address
        self.single_tenant = single_tenant
        self.process_user = process_user
        self.user = self._user()  # refused here: the agent does not start
        # Beside the state directory, not in it: the state directory is the agent's alone (0700).
        self.work_dir = Path(process_work_dir or f"{self.state_dir}-workloads")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.work_dir.stat().st_uid == os.geteuid():
            os.chmod(self.work_dir, 0o711)  # the user reaches its own directory, lists nobody's
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._sessions: dict[str, set[int]] = {}  # SSH sessions' process groups, per workload

    def _user(self) -> ProcessUser:
        return process_user(single_tenant=self.single_tenant, user=self.process_user)

    def workload_dir(self, workload_id: str) -> Path:
        """``<work dir>/<id>``: root's (the preemption notice); the workload only reads it."""
        path = self.work_dir / safe_name(workload_id)
        path.mkdir(exist_ok=True)
        os.chmod(path, 0o755)
        return path

    def notify_preempt(self, workload_id: str, notice_s: float) -> None:
        super().notify_preempt(workload_id, notice_s)
        # Readable by the workload's user whatever the agent's umask (systemd's unit sets 0077).
        os.chmod(self.workload_dir(workload_id) / "preempt", 0o644)

    def _home(self, workload_id: str, user: ProcessUser) -> Path:
        """``<work dir>/<id>/home``: the user's working directory, 0700."""
        home = self.workload_dir(workload_id) / "home"
        home.mkdir(exist_ok=True)
        if user.switch:
            os.chown(home, user.uid, user.gid, follow_symlinks=False)
        os.chmod(home, 0o700)
        return home

    @staticmethod
    def _link_volumes(home: Path, prepared: Prepared) -> None:
        """Each volume as a link in the working directory (one level: ``home`` is the agent's
        child, and a link or file the workload left there under that name is replaced or refused,
        never followed)."""
        for v in prepared.volumes:
            link = home / v.mount_path.strip("/").replace("/", "_")
            if link.is_symlink():
                link.unlink()
            elif link.exists():
                raise RuntimeFailure(
                    f"{link.name} in the working directory is in the way of volume {v.volume_id}"
                )
            os.symlink(v.host_path, link)

    def _host_ports(self, ports: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, str]]:
        """(container port -> host port, the variables that tell the workload where to listen)."""
        mapping: dict[str, int] = {}
        env: dict[str, str] = {}
        for item in ports:
            address = self.tcp_publish_address if item["protocol"] == "tcp" else self.publish_address
            try:
                host_port = free_port(address)
            except OSError as exc:
                raise RuntimeFailure(f"no free port on {address} for port {item['port']}: {exc}") from exc
            mapping[str(item["port"])] = host_port
            env[f"GPUPOOL_PORT_{item['port']}"] = str(host_port)
            env[f"GPUPOOL_PORT_{item['port']}_ADDRESS"] = address
        return mapping, env

    def _environment(
        self, spec: WorkloadSpec, user: ProcessUser, home: Path, prepared: Prepared
    ) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH") or DEFAULT_PATH}
        if os.environ.get("LANG"):
            env["LANG"] = os.environ["LANG"]
        env.update({"HOME": str(home), "USER": user.name, "LOGNAME": user.name})
        env.update(spec.env)  # checked by the workload rules: no platform name among them
        plan = self.device_plan(spec)
        if plan is None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        else:
            env.update(plan.process_env)  # HIP reads CUDA_VISIBLE_DEVICES too: not set here
        env["GPUPOOL_WORKLOAD_ID"] = spec.workload_id
        env["GPUPOOL_PREEMPT_NOTICE_FILE"] = str(self.workload_dir(spec.workload_id) / "preempt")
        env["GPUPOOL_RESIZE_FILE"] = str(self.workload_dir(spec.workload_id) / "resize")
        env.update(self.sharing_env(spec))
        env.update(spec.platform_env)
        env.update(volume_env(prepared, str(prepared.checkpoint_host)))
        return env

    @staticmethod
    def _launch_options(
        user: ProcessUser, home: Path, env: dict[str, str], groups: list[int] | tuple[int, ...] = ()
    ) -> dict[str, Any]:
        """How every process of a workload starts, its command and its SSH sessions alike: as its
        user (no supplementary groups but those owning its AMD or Intel GPUs' device files), in its
        home, with exactly its environment, in a session of its own, files private by default."""
        identity: dict[str, Any] = (
            {"user": user.uid, "group": user.gid, "extra_groups": [g for g in groups if g != 0]}
            if user.switch
            else {}
        )
        return {"env": env, "cwd": home, "start_new_session": True, "umask": 0o077, **identity}

    def session_options(self, workload_id: str, term: str | None) -> dict[str, Any]:
        """The ``Popen`` options of an SSH session into a running workload (nodes/agent/ssh.py):
        the workload's own user, working directory and environment (plus ``TERM`` for a
        terminal). :class:`RuntimeFailure` unless it runs on this node."""
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None or self._status(workload_id, record).terminal:
                raise RuntimeFailure(f"workload {workload_id} is not running on this node")
            if "env" not in record:
                raise RuntimeFailure(
                    f"workload {workload_id} was started by an agent without SSH sessions; restart it"
                )
            user = self._user()
            env = dict(record["env"])
            if term:
                env["TERM"] = term
            return self._launch_options(user, Path(record["home"]), env, record.get("groups") or ())

    def session_started(self, workload_id: str, pid: int) -> None:
        """An SSH session's process (the leader of its own group): stopped with the workload."""
        self._sessions.setdefault(workload_id, set()).add(pid)

    def session_ended(self, workload_id: str, pid: int) -> None:
        self._sessions.get(workload_id, set()).discard(pid)

    def _end_sessions(self, workload_id: str) -> None:
        for pgid in self._sessions.pop(workload_id, set()):
            self._signal(pgid, signal.SIGKILL)

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        with self.store.lock:
            record = self.store.records.get(spec.workload_id)
            if record is not None:
                return WorkloadHandle(spec.workload_id, str(record["pid"]), dict(record.get("ports") or {}))
            user = self._user()  # again at each start: the setting and the user as they are now
            try:  # the agent checked the payload; a runtime called directly checks it here
                check_command(spec.command)
                check_env(spec.env)
                check_platform_env(spec.platform_env)
                if spec.gang_network is not None:
                    raise WorkloadRuleError("gang_network", "Host processes join no gang network.")
                check_gpu_uuids(spec.gpu_uuids)
                ports = check_ports(spec.ports)
            except WorkloadRuleError as exc:
                raise RuntimeFailure(str(exc)) from exc
            if not spec.command:
                raise RuntimeFailure("the subprocess runtime needs a command")
            host_ports, port_env = self._host_ports(ports)
            home = self._home(spec.workload_id, user)
            prepared = self.volumes.prepare(spec, owner=(user.uid, user.gid) if user.switch else None)
            self._link_volumes(home, prepared)
            log_dir = self.state_dir / "process-logs"
            log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            log_path = log_dir / f"{safe_name(spec.workload_id)}.log"
            err_path = log_dir / f"{safe_name(spec.workload_id)}.err"
            environment = {**self._environment(spec, user, home, prepared), **port_env}
            plan = self.device_plan(spec)
            groups = list(plan.groups) if plan is not None else []
            with open(log_path, "ab") as log_file, open(err_path, "ab") as err_file:
                try:
                    proc = subprocess.Popen(
                        spec.command,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=err_file,
                        **self._launch_options(user, home, environment, groups),
                    )
                except OSError as exc:
                    raise RuntimeFailure(f"cannot run {spec.command[0]!r}: {exc}") from exc
            self._procs[spec.workload_id] = proc
            self.store.records[spec.workload_id] = {
                "pid": proc.pid,
                "pgid": proc.pid,
                "command": list(spec.command),  # started again by an elastic restart
                # What an SSH session into the workload gets again (the agent's state directory
                # is its alone, 0700: the env may hold the tenant's secrets).
                "env": environment,
                "home": str(home),
                "groups": groups,
                "gpu_uuids": spec.gpu_uuids,
                "log": str(log_path),
                "err": str(err_path),
                "started_at": time.time(),
                "finished_at": None,
                "exit_code": None,
                "final_state": None,
                "message": "",
                "ports": host_ports,
            }
            self.store.save()
            return WorkloadHandle(spec.workload_id, str(proc.pid), dict(host_ports))

    def _refresh(self, workload_id: str, record: dict[str, Any]) -> None:
        """Record the exit of a finished process (once)."""
        if record["finished_at"] is not None:
            return
        proc = self._procs.get(workload_id)
        if proc is not None:
            returncode = proc.poll()
            if returncode is None:
                return
            record["exit_code"] = _exit_code(returncode)
        elif _alive(record["pid"]):
            return
        else:
            # Started by an earlier run of the agent: its exit code went with that process.
            record["message"] = "the process ended while the agent was not running; its exit code is unknown"
        record["finished_at"] = time.time()
        self.store.save()
        self._end_sessions(workload_id)  # a workload that ended takes its SSH sessions along

    def _status(self, workload_id: str, record: dict[str, Any]) -> WorkloadStatus:
        self._refresh(workload_id, record)
        common = {
            "workload_id": workload_id,
            "started_at": record["started_at"],
            "gpu_uuids": record["gpu_uuids"],
            "message": record["message"],
        }
        if record["finished_at"] is None:
            return WorkloadStatus(state=RUNNING, **common)
        code = record["exit_code"]
        state = record["final_state"] or (EXITED if code == 0 else FAILED)
        return WorkloadStatus(state=state, exit_code=code, finished_at=record["finished_at"], **common)

    def status(self) -> list[WorkloadStatus]:
        with self.store.lock:
            return [self._status(wid, record) for wid, record in self.store.items()]

    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None:
                return WorkloadStatus(
                    workload_id=workload_id, state=final_state, message="not known on this node"
                )
            current = self._status(workload_id, record)
            if current.terminal:
                return current
            record["final_state"] = final_state
            self.store.save()
        self._signal(record["pgid"], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self._status(workload_id, record).terminal:
            time.sleep(0.05)
        if not self._status(workload_id, record).terminal:
            self._signal(record["pgid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not self._status(workload_id, record).terminal:
                time.sleep(0.05)
        # The leader may be gone while others of its group live on; they go too, and so do the
        # SSH sessions into it.
        self._signal(record["pgid"], signal.SIGKILL)
        self._end_sessions(workload_id)
        return self._status(workload_id, record)

    def signal_resize(self, workload_id: str, info: dict[str, Any]) -> None:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None or self._status(workload_id, record).terminal:
                raise RuntimeFailure(f"workload {workload_id} is not running on this node")
            record["gpu_uuids"] = list(info["gpu_uuids"])
            self.store.save()
        self._signal(record["pgid"], signal.SIGUSR1)

    def restart_resized(self, workload_id: str, info: dict[str, Any], grace_s: float) -> None:
        # Under the store's lock throughout: no status is read between the stop and the new start,
        # so the portal never hears of an end.
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None or self._status(workload_id, record).terminal:
                raise RuntimeFailure(f"workload {workload_id} is not running on this node")
            if "command" not in record or "env" not in record:
                raise RuntimeFailure(
                    f"workload {workload_id} was started by an older agent; it cannot restart"
                )
            self._signal(record["pgid"], signal.SIGTERM)
            proc = self._procs.get(workload_id)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (proc.poll() is None if proc else _alive(record["pid"])):
                time.sleep(0.05)
            self._signal(record["pgid"], signal.SIGKILL)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            env = dict(record["env"])
            uuids = list(info["gpu_uuids"])
            env.update(
                CUDA_VISIBLE_DEVICES=",".join(uuids),
                WORLD_SIZE=str(info["world_size"]),
                LOCAL_WORLD_SIZE=str(len(uuids)),
                GPUPOOL_RESUME="1",
            )
            with open(record["log"], "ab") as log_file, open(record["err"], "ab") as err_file:
                try:
                    new = subprocess.Popen(
                        record["command"],
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=err_file,
                        **self._launch_options(self._user(), Path(record["home"]), env),
                    )
                except OSError as exc:
                    record["finished_at"], record["exit_code"] = time.time(), 127
                    record["message"] = f"elastic restart failed: {exc}"
                    self.store.save()
                    raise RuntimeFailure(f"cannot restart {record['command'][0]!r}: {exc}") from exc
            self._procs[workload_id] = new
            record.update(pid=new.pid, pgid=new.pid, env=env, gpu_uuids=uuids)
            self.store.save()

    @staticmethod
    def _signal(pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    def logs(self, workload_id: str, tail: int = 100) -> str:
        """The last ``tail`` lines of stdout, then of stderr."""
        record = self.store.records.get(workload_id)
        if record is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        text = ""
        for path in filter(None, (record["log"], record.get("err"))):
            try:
                with open(path, errors="replace") as handle:
                    text += "".join(deque(handle, maxlen=tail))
            except FileNotFoundError:
                pass
        return text

    def output(
        self, workload_id: str, cursor: dict[str, Any], limit: int
    ) -> tuple[list[OutputLine], dict[str, Any]]:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None:
                return [], cursor
            finished = self._status(workload_id, record).terminal
        lines: list[OutputLine] = []
        cursor = dict(cursor)
        for stream, path in (("stdout", record["log"]), ("stderr", record.get("err"))):
            if path and len(lines) < limit:
                new, cursor[stream] = read_new_lines(
                    path, int(cursor.get(stream, 0)), limit - len(lines), stream, final=finished
                )
                lines.extend(new)
        return lines, cursor

    def prewarm(self, image: str) -> dict[str, Any]:
        return {
            "image": image,
            "pulled": False,
            "message": "the subprocess runtime runs host commands; no image",
        }

    def forget(self, workload_id: str) -> None:
        proc = self._procs.get(workload_id)
        if proc is not None and proc.poll() is None:
            return  # still running: keep it
        self._procs.pop(workload_id, None)
        super().forget(workload_id)

    def workload_for_pid(self, pid: int) -> str | None:
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((wid for wid, record in self.store.items() if record["pgid"] == pgid), None)
