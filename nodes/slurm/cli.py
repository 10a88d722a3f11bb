"""The Slurm connector: Slurm's own commands, their JSON output (``--json``, Slurm 22.05 and
later) read into plain dataclasses. Every call is an argv list (never a shell), with SLURM_CONF
set to the region's slurm.conf where it names one and a timeout; a failure is a ``SlurmError``
with what the command said.

Why the commands and not slurmrestd: they need nothing deployed beyond what every login node has
(munge and slurm.conf, no JWT keys to hand out and rotate), and they answer the same on a cluster
whose REST daemon is not running; the JSON they print is the same data parser slurmrestd uses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from nodes.slurm.config import SlurmConfig

GRES_RE = re.compile(r"^gpu:(?P<type>[A-Za-z0-9_.-]+):(?P<count>\d+)")
# GRES as sacct's TRES names it: gres/gpu:<type>.
TRES_GPU_TYPE_RE = re.compile(r"^gpu:(?P<type>[A-Za-z0-9_.-]+)$")
JOB_NAME_PREFIX = "gpupool-"


class SlurmError(Exception):
    """A Slurm command failed or answered what we cannot read. ``transient``: Slurm could not be
    asked (no answer in time, the command or slurm.conf missing), as opposed to Slurm refusing."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # Slurm's, lower case: idle, mixed, allocated, down, drained, ...
    flags: tuple[str, ...]
    partitions: tuple[str, ...]
    cpus: int
    memory_mib: int
    gpus: dict[str, int]  # GRES type -> count
    reason: str
    address: str
    gpus_used: dict[str, int] = field(default_factory=dict)  # GRES type -> count Slurm has allocated


# A job as gpupool follows it: (job id, None) for a job, (array job id, task index) for an array task.
JobKey = tuple[int, int | None]


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, ...
    reason: str
    start: datetime | None
    end: datetime | None
    exit_code: int | None
    nodes: str
    submitted: datetime | None = None
    array_job_id: int = 0
    array_task_id: int | None = None
    # Where it runs: (node name, its GRES there: type -> count), in Slurm's node order.
    node_gres: tuple[tuple[str, dict[str, int]], ...] = ()

    @property
    def key(self) -> JobKey:
        return (self.array_job_id, self.array_task_id) if self.array_job_id else (self.job_id, None)


@dataclass(frozen=True)
class SlurmAccounting:
    job_id: int  # an array task's own id (its JobIDRaw)
    state: str
    start: datetime | None
    end: datetime | None
    elapsed_s: int
    exit_code: int | None
    nodes: str
    gpus: dict[str, int] = field(default_factory=dict)  # GRES type -> count allocated
    cpus: int = 0
    memory_mib: int = 0
    array_job_id: int = 0
    array_task_id: int | None = None
    node_count: int = 1
    # An array's own record: the tasks it stands for, which never started (``array.task``).
    unstarted_tasks: frozenset[int] = frozenset()
    submitted: datetime | None = None

    @property
    def key(self) -> JobKey:
        return (self.array_job_id, self.array_task_id) if self.array_job_id else (self.job_id, None)


def array_task_ids(text: str) -> list[int]:
    """The task indexes of squeue's ``array_task_string`` (``2-9%2``, ``1,3,5-7``, ``0-8:2``)."""
    out: list[int] = []
    for part in (text or "").split("%")[0].split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if not m:
            continue
        lo = int(m[1])
        hi = int(m[2]) if m[2] else lo
        out.extend(range(lo, hi + 1, int(m[3] or 1)))
    return out


def _task_set(value: Any) -> frozenset[int]:
    """sacct's ``array.task`` of an array's own record: a hex bitmap (``0xE``: tasks 1-3) or a
    range list (``1-3``)."""
    text = str(value or "")
    if text.lower().startswith("0x"):
        try:
            bits = int(text, 16)
        except ValueError:
            return frozenset()
        return frozenset(i for i in range(bits.bit_length()) if bits >> i & 1)
    return frozenset(array_task_ids(text))


def _time(value: Any) -> datetime | None:
    if isinstance(value, dict):  # later releases: {"set": true, "number": N}
        value = value.get("number") if value.get("set", True) else None
    if not isinstance(value, int) or value <= 0:
        return None
    return datetime.fromtimestamp(value, tz=UTC)


def _int(value: Any) -> int | None:
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_gres(text: str) -> dict[str, int]:
    """``gpu:h100:2,gpu:a100:2(S:0)`` -> {"h100": 2, "a100": 2}; untyped GPUs count as ''."""
    out: dict[str, int] = {}
    for part in (text or "").split(","):
        m = GRES_RE.match(part.strip())
        if m:
            out[m["type"]] = out.get(m["type"], 0) + int(m["count"])
        elif re.match(r"^gpu:\d+", part.strip()):
            out[""] = out.get("", 0) + int(part.strip().split(":")[1].split("(")[0])
    return out


def nodes_from_json(data: dict[str, Any]) -> list[SlurmNode]:
    """Slurm's nodes of ``sinfo --json`` or slurmrestd's ``GET .../nodes`` (one data parser)."""
    seen: dict[str, SlurmNode] = {}
    for n in data.get("nodes", []):
        name = str(n.get("name", ""))
        if not name or name in seen:
            continue
        state = n.get("state", "")
        if isinstance(state, list):
            state = state[0] if state else ""
        seen[name] = SlurmNode(
            name=name,
            state=str(state).lower(),
            flags=tuple(str(f).lower() for f in n.get("state_flags", []) or []),
            partitions=tuple(str(p) for p in n.get("partitions", []) or []),
            cpus=_int(n.get("cpus")) or 0,
            memory_mib=_int(n.get("real_memory")) or 0,
            gpus=parse_gres(str(n.get("gres", ""))),
            reason=str(n.get("reason", "") or ""),
            address=str(n.get("address", "") or ""),
            gpus_used=parse_gres(str(n.get("gres_used", "") or "")),
        )
    return list(seen.values())


def jobs_from_json(data: dict[str, Any]) -> dict[JobKey, SlurmJob]:
    """gpupool's jobs that slurmctld still knows (pending, running, and ended for MinJobAge), by
    ``SlurmJob.key``: an array's tasks one by one, those still pending in the array's own record
    (``array_task_string``) each under its index with that record's state and reason."""
    out = {}
    for j in data.get("jobs", []):
        name = str(j.get("name", ""))
        if not name.startswith(JOB_NAME_PREFIX):
            continue
        jid = _int(j.get("job_id"))
        if jid is None:
            continue
        state = j.get("job_state", "")
        if isinstance(state, list):
            state = state[0] if state else ""
        hosts = [
            str(n.get("nodename", ""))
            for n in ((j.get("job_resources") or {}).get("allocated_nodes") or [])
            if isinstance(n, dict)
        ]
        detail = [parse_gres(str(g)) for g in (j.get("gres_detail") or [])]
        array_job = _int(j.get("array_job_id")) or 0
        job = SlurmJob(
            job_id=jid,
            name=name,
            state=str(state).upper(),
            reason=str(j.get("state_reason", "") or ""),
            start=_time(j.get("start_time")),
            end=_time(j.get("end_time")),
            exit_code=_int(j.get("exit_code")),
            nodes=str(j.get("nodes", "") or ""),
            submitted=_time(j.get("submit_time")),
            array_job_id=array_job,
            array_task_id=_int(j.get("array_task_id")) if array_job else None,
            node_gres=tuple(zip(hosts, detail, strict=False)) if len(hosts) == len(detail) else (),
        )
        if array_job and job.array_task_id is None:
            for i in array_task_ids(str(j.get("array_task_string", ""))):
                out[(array_job, i)] = replace(job, array_task_id=i)
        else:
            out[job.key] = job
    return out


def accounting_from_json(data: dict[str, Any], codes: dict[int, int | None]) -> dict[JobKey, SlurmAccounting]:
    """Records of ``sacct --json`` or slurmrestd's ``GET /slurmdb/.../job/{id}`` by
    ``SlurmAccounting.key`` (of a job id given more than once, the newest submission); ``codes``:
    exit codes by job id that override the JSON's (22.05 writes a failed job's as 0)."""
    out: dict[JobKey, SlurmAccounting] = {}
    submitted: dict[JobKey, int] = {}
    for j in data.get("jobs", []):
        jid = _int(j.get("job_id"))
        if jid is None:
            continue
        array = j.get("array") or {}
        array_job = _int(array.get("job_id")) or 0
        array_task = _int(array.get("task_id")) if array_job else None
        # (An array's record whose task is None stands for its tasks not started: they have no
        # record of their own; its state says what became of them.)
        gpus: dict[str, int] = {}
        cpus = mem = 0
        node_count = 1
        for t in (j.get("tres") or {}).get("allocated", []) or []:
            count = _int(t.get("count")) or 0
            if t.get("type") == "node":
                node_count = max(1, count)
            if t.get("type") == "gres" and t.get("name"):
                m = TRES_GPU_TYPE_RE.match(str(t["name"]))
                if m:
                    gpus[m["type"]] = count
            elif t.get("type") == "cpu":
                cpus = count
            elif t.get("type") == "mem":
                mem = count
        state = (j.get("state") or {}).get("current", "")
        if isinstance(state, list):
            state = state[0] if state else ""
        times = j.get("time") or {}
        exit_code = codes[jid] if jid in codes else (j.get("exit_code") or {}).get("return_code")
        acct = SlurmAccounting(
            job_id=jid,
            state=str(state).upper(),
            start=_time(times.get("start")),
            end=_time(times.get("end")),
            elapsed_s=_int(times.get("elapsed")) or 0,
            exit_code=_int(exit_code),
            nodes="" if str(j.get("nodes", "")) == "None assigned" else str(j.get("nodes", "") or ""),
            gpus=gpus,
            cpus=cpus,
            memory_mib=mem,
            array_job_id=array_job,
            array_task_id=array_task,
            node_count=node_count,
            unstarted_tasks=_task_set(array.get("task")) if array_task is None else frozenset(),
            submitted=_time(times.get("submission")),
        )
        at = _int(times.get("submission")) or 0
        if at >= submitted.get(acct.key, 0):
            out[acct.key], submitted[acct.key] = acct, at
    return out


class SlurmCli:
    def __init__(self, config: SlurmConfig):
        self.config = config

    def run(self, argv: list[str], *, stdin: str | None = None) -> str:
        env = dict(os.environ)
        if self.config.slurm_conf:
            # Without it the commands look for the cluster in DNS for a minute before giving up.
            if not os.path.isfile(self.config.slurm_conf):
                raise SlurmError(f"{self.config.slurm_conf} is not on this host", transient=True)
            env["SLURM_CONF"] = self.config.slurm_conf
        try:
            done = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=self.config.timeout_s,
                env=env,
                check=False,
            )
        except FileNotFoundError as exc:
            raise SlurmError(f"{argv[0]} is not installed on this host", transient=True) from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(
                f"{argv[0]} did not answer within {self.config.timeout_s} s", transient=True
            ) from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise SlurmError(f"{' '.join(argv[:2])} failed: {said[-1] if said else done.returncode}")
        return done.stdout

    def _json(self, argv: list[str]) -> dict[str, Any]:
        out = self.run(argv)
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise SlurmError(f"{argv[0]} --json printed no JSON") from exc
        if not isinstance(data, dict):
            raise SlurmError(f"{argv[0]} --json printed no object")
        return data

    # --- inventory ---------------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        return nodes_from_json(self._json(["sinfo", "--json"]))

    # --- jobs ------------------------------------------------------------------------------------

    def submit(self, *, options: list[str], script: str) -> int:
        out = self.run(["sbatch", "--parsable", *options], stdin=script).strip()
        try:
            return int(out.split(";")[0])
        except ValueError as exc:
            raise SlurmError(f"sbatch printed no job id: {out[:100]!r}") from exc

    def jobs(self) -> dict[JobKey, SlurmJob]:
        """gpupool's jobs that slurmctld still knows (``jobs_from_json``)."""
        return jobs_from_json(self._json(["squeue", "--json"]))

    def accounting(self, job_ids: list[int]) -> dict[JobKey, SlurmAccounting]:
        """Accounting (slurmdbd) of these jobs (an array job: each of its tasks), by
        ``SlurmAccounting.key``: one row per job or task, steps left out."""
        if not job_ids:
            return {}
        ids = ",".join(str(int(i)) for i in sorted(set(job_ids)))
        data = self._json(["sacct", "--json", "-j", ids])
        # Slurm 22.05's JSON writes a failed job's exit code as 0 ("SUCCESS"); the parsable text
        # has it right ("1:0": code 1, signal 0), so the code is read from there, by JobIDRaw.
        # A job id Slurm gave again (its counter reset, or past MaxJobId) has older records in
        # slurmdbd too: the newest submission is the one.
        codes: dict[int, tuple[str, int]] = {}
        for line in self.run(
            ["sacct", "-n", "-P", "-X", "-o", "JobIDRaw,ExitCode,Submit", "-j", ids]
        ).splitlines():
            jid, code, submit = [*line.split("|"), "", ""][:3]
            if jid.isdigit() and code.partition(":")[0].isdigit() and submit >= codes.get(int(jid), ("",))[0]:
                codes[int(jid)] = (submit, int(code.partition(":")[0]))
        return accounting_from_json(data, {jid: code for jid, (_, code) in codes.items()})

    def cancel(self, job_id: int, task: int | None = None) -> None:
        """scancel a job, a whole array job (every task: one command), or one task of it."""
        self.run(["scancel", str(int(job_id)) if task is None else f"{int(job_id)}_{int(task)}"])

    def hostnames(self, nodelist: str) -> list[str]:
        """A node list (``gpu-[01-03],big``) as node names, as Slurm expands it."""
        if not nodelist or nodelist == "None assigned":
            return []
        if "[" not in nodelist:
            return [n for n in nodelist.split(",") if n]
        return self.run(["scontrol", "show", "hostnames", nodelist]).split()

    # --- accounts --------------------------------------------------------------------------------

    def associations(self) -> set[tuple[str, str]]:
        out = self.run(["sacctmgr", "-n", "-P", "show", "associations", "format=account,user"])
        pairs = set()
        for line in out.splitlines():
            account, _, user = line.partition("|")
            pairs.add((account.strip(), user.strip()))
        return pairs

    def account_ensure(self, *, account: str, description: str, user: str) -> bool:
        """Make the account and the user's association in it where missing; True if it made any."""
        have = self.associations()
        made = False
        if not any(a == account for a, _ in have):
            self.run(
                [
                    "sacctmgr",
                    "-i",
                    "add",
                    "account",
                    account,
                    f"description={description}",
                    "organization=gpupool",
                ]
            )
            made = True
        if (account, user) not in have:
            self.run(["sacctmgr", "-i", "add", "user", user, f"account={account}"])
            made = True
        return made
