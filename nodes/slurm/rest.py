"""The Slurm connector over slurmrestd: the same operations as ``SlurmCli`` (inventory, submit,
job states, cancel, accounting, accounts) through slurmrestd's documented OpenAPI, plugins
``openapi/v0.0.38`` and ``openapi/dbv0.0.38`` (Slurm 22.05 to 23.02), with httpx.

Every request carries ``X-SLURM-USER-NAME`` (the region's ``rest_user``) and
``X-SLURM-USER-TOKEN`` (the JWT read from ``jwt_file`` at each use, so an operator rotates it by
rewriting the file). The answers are the same data parser's JSON as the commands' ``--json``, read
by the same functions (``nodes_from_json``, ``jobs_from_json``, ``accounting_from_json``).

A job is submitted as ``POST /slurm/v0.0.38/job/submit`` with the batch script and the job's
properties translated from the sbatch options ``sbatch_request`` makes (``job_properties``). Its
accounting is ``GET /slurmdb/v0.0.38/job/{id}``. What differs from the commands: slurmdbd's JSON
in 22.05 writes a failed job's exit code as 0 and slurmrestd has no parsable text to correct it
from, so a failed job's exit code is unknown (None) there; node lists are expanded here
(``expand_hostlist``), not by ``scontrol``.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from nodes.slurm.cli import (
    JobKey,
    SlurmAccounting,
    SlurmCli,
    SlurmError,
    SlurmJob,
    SlurmNode,
    accounting_from_json,
    jobs_from_json,
    nodes_from_json,
)
from nodes.slurm.config import SlurmConfig

API = "v0.0.38"
MAX_TOKEN_BYTES = 16 * 1024
# Slurm's codes for "no such job" and "job already done" when cancelling.
GONE_ERRORS = {2017, 2021}


def expand_hostlist(text: str) -> list[str]:
    """Slurm's node list as names: ``gpu-[01-03,07],big`` -> gpu-01, gpu-02, gpu-03, gpu-07, big
    (one bracket per name, as Slurm writes node lists of one dimension)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text or ""):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            out.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise SlurmError(f"cannot read the node list {text!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return out


def job_properties(options: list[str]) -> dict[str, Any]:
    """The v0.0.38 job properties of the sbatch options ``sbatch_request`` makes (each
    ``--name=value`` or a flag); an option it does not make is a programming error."""
    job: dict[str, Any] = {}
    for option in options:
        name, _, value = option.partition("=")
        match name:
            case "--job-name":
                job["name"] = value
            case "--comment":
                job["comment"] = value
            case "--account":
                job["account"] = value
            case "--gres":
                job["gres"] = value
            case "--nodes":
                job["nodes"] = int(value)
                job["minimum_nodes"] = int(value)
            case "--cpus-per-task":
                job["cpus_per_task"] = int(value)
            case "--output":
                job["standard_output"] = job["standard_error"] = value
            case "--chdir":
                job["current_working_directory"] = value
            case "--export":
                if value != "NONE":
                    raise ValueError(f"unexpected sbatch option {option!r}")
                # The batch script exports the job's variables itself; Slurm wants one here.
                job["environment"] = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
            case "--no-requeue":
                # (22.05's v0.0.38 parser ignores false: Slurm may requeue on a node failure, and
                # the sync follows that, ``scheduling.services.slurm._follow``.)
                job["requeue"] = False
            case "--ntasks":
                job["tasks"] = int(value)
            case "--ntasks-per-node":
                job["tasks_per_node"] = int(value)
            case "--array":
                job["array"] = value
            case "--mem":
                job["memory_per_node"] = int(value.removesuffix("M"))
            case "--time":
                job["time_limit"] = int(value)
            case "--dependency":
                job["dependency"] = value
            case "--kill-on-invalid-dep":
                job["kill_on_invalid_dependency"] = value == "yes"
            case "--partition":
                job["partition"] = value
            case "--qos":
                job["qos"] = value
            case _:
                raise ValueError(f"unexpected sbatch option {option!r}")
    if "tasks_per_node" in job:
        job["tasks"] = job["tasks_per_node"] * job.get("nodes", 1)
    return job


class SlurmRest:
    def __init__(self, config: SlurmConfig):
        self.config = config

    def _token(self) -> str:
        try:
            with open(self.config.jwt_file, "rb") as fh:
                token = fh.read(MAX_TOKEN_BYTES + 1).decode("ascii", "replace").strip()
        except OSError as exc:
            raise SlurmError(f"cannot read the token file {self.config.jwt_file}", transient=True) from exc
        token = token.removeprefix("SLURM_JWT=")  # as `scontrol token` prints it
        if not token or len(token) > MAX_TOKEN_BYTES or not re.fullmatch(r"[A-Za-z0-9._-]+", token):
            raise SlurmError(f"{self.config.jwt_file} holds no JWT", transient=True)
        return token

    def request(
        self, method: str, path: str, *, body: dict | None = None, accept_errors: bool = False
    ) -> dict[str, Any]:
        """One call; ``SlurmError`` with Slurm's words when it answers errors (``transient`` when
        slurmrestd cannot be reached, or refuses the token: nothing about the job is wrong)."""
        url = f"{self.config.rest_url}{path}"
        headers = {"X-SLURM-USER-NAME": self.config.rest_user, "X-SLURM-USER-TOKEN": self._token()}
        try:
            r = httpx.request(
                method, url, json=body, headers=headers, timeout=self.config.timeout_s, follow_redirects=False
            )
        except httpx.HTTPError as exc:
            raise SlurmError(
                f"slurmrestd at {self.config.rest_url} does not answer: {exc}", transient=True
            ) from exc
        if r.status_code in (401, 403):
            raise SlurmError(f"slurmrestd refused the token ({r.status_code})", transient=True)
        try:
            data = r.json()
        except ValueError:
            raise SlurmError(
                f"slurmrestd answered {r.status_code} without JSON to {method} {path}",
                transient=r.status_code >= 500 or r.status_code == 404,
            ) from None
        if not isinstance(data, dict):
            raise SlurmError(f"slurmrestd answered no object to {method} {path}")
        errors = [e for e in data.get("errors") or [] if isinstance(e, dict)]
        if accept_errors and r.status_code < 400:
            return data
        if errors or r.status_code >= 400:
            said = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
            error = SlurmError(f"{method} {path} failed: {said or r.status_code}")
            error.codes = {e.get("error_number") or e.get("error_code") for e in errors}  # type: ignore[attr-defined]
            raise error
        return data

    # --- inventory ---------------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        return nodes_from_json(self.request("GET", f"/slurm/{API}/nodes"))

    # --- jobs ------------------------------------------------------------------------------------

    def submit(self, *, options: list[str], script: str) -> int:
        # A job id is a job made, whatever notes come with it (e.g. "held"); no id is a refusal.
        data = self.request(
            "POST",
            f"/slurm/{API}/job/submit",
            body={"script": script, "job": job_properties(options)},
            accept_errors=True,
        )
        job_id = data.get("job_id")
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            said = "; ".join(
                str(e.get("description") or e.get("error") or e)
                for e in data.get("errors") or []
                if isinstance(e, dict)
            )
            raise SlurmError(f"job submit failed: {said or 'no job id'}")
        return job_id

    def jobs(self) -> dict[JobKey, SlurmJob]:
        return jobs_from_json(self.request("GET", f"/slurm/{API}/jobs"))

    def accounting(self, job_ids: list[int]) -> dict[JobKey, SlurmAccounting]:
        records: list[dict[str, Any]] = []
        for job_id in sorted(set(job_ids)):
            try:
                records += self.request("GET", f"/slurmdb/{API}/job/{int(job_id)}").get("jobs") or []
            except SlurmError as exc:
                if exc.transient:
                    raise
                continue  # slurmdbd has no record of it yet: the next sync asks again
        # 22.05 writes a failed job's exit code as 0: unknown here (see the module docstring). Per
        # record, not per job id: slurmdbd may hold an older job of the same id (ids wrap, or the
        # controller's state was made anew), and the newest record is the one that counts.
        for j in records:
            code = (j.get("exit_code") or {}).get("return_code")
            if (j.get("state") or {}).get("current") not in ("COMPLETED",) and code == 0:
                j["exit_code"] = {**j["exit_code"], "return_code": None}
        return accounting_from_json({"jobs": records}, {})

    def cancel(self, job_id: int, task: int | None = None) -> None:
        label = str(int(job_id)) if task is None else f"{int(job_id)}_{int(task)}"
        try:
            self.request("DELETE", f"/slurm/{API}/job/{label}")
        except SlurmError as exc:
            if not (getattr(exc, "codes", set()) & GONE_ERRORS):
                raise

    def hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist == "None assigned":
            return []
        return expand_hostlist(nodelist)

    # --- accounts --------------------------------------------------------------------------------

    def account_ensure(self, *, account: str, description: str, user: str) -> bool:
        """Make the account (under root) and the user's association in it where missing
        (slurmdbd's ``/accounts`` and ``/associations``, on the cluster the existing associations
        name; the user must be known to slurmdbd, as the token's user is)."""
        have = self.request("GET", f"/slurmdb/{API}/associations").get("associations") or []
        clusters = {str(a.get("cluster")) for a in have if a.get("cluster")}
        if len(clusters) != 1:
            raise SlurmError(f"slurmdbd serves {len(clusters)} clusters; cannot tell which is this region's")
        (cluster,) = clusters

        def qos_of(name: str) -> dict[str, list[str]]:
            # slurmdbd's REST gives a new association no QOS (sacctmgr inherits its parent's): the
            # account's own association's, or root's for a new account.
            own = next((a for a in have if a.get("account") == name and not a.get("user")), None)
            qos = (own or {}).get("qos")
            return {"qos": [str(q) for q in qos]} if isinstance(qos, list) and qos else {}

        made = False
        if not any(a.get("account") == account for a in have):
            self.request(
                "POST",
                f"/slurmdb/{API}/accounts",
                body={"accounts": [{"name": account, "description": description, "organization": "gpupool"}]},
            )
            # The account's own association in the cluster (sacctmgr makes it with the account;
            # slurmdbd's REST does not), under root, before any user's.
            inherited = qos_of("root")
            self.request(
                "POST",
                f"/slurmdb/{API}/associations",
                body={
                    "associations": [
                        {
                            "account": account,
                            "cluster": cluster,
                            "user": "",
                            "parent_account": "root",
                            **inherited,
                        }
                    ]
                },
            )
            made = True
        else:
            inherited = qos_of(account)
        if not any(a.get("account") == account and a.get("user") == user for a in have):
            self.request(
                "POST",
                f"/slurmdb/{API}/associations",
                body={"associations": [{"account": account, "cluster": cluster, "user": user, **inherited}]},
            )
            made = True
        return made


SlurmConnector = SlurmCli | SlurmRest


def slurm_connector_for(config: SlurmConfig) -> SlurmConnector:
    """The connector the region's configuration names."""
    return SlurmRest(config) if config.connector == "rest" else SlurmCli(config)
