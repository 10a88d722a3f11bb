"""The real single-host Slurm cluster of the Slurm region's tests, made ready by
``scripts/slurm-up`` (``make test`` runs it): munged, slurmdbd on the local MariaDB, slurmctld and
two slurmds on this one host: node ``NODE`` with GRES ``gpu:h100:2,gpu:a100:2`` (partitions ``gpu``
and ``batch``) and node ``NODE2`` with ``gpu:h100:2``; partition ``multi`` has both (multi-node
jobs). All under /var/lib/gpupool-slurm.

Where it does not answer, the tests that need it skip with the reason (``scripts/slurm-up`` writes
its own to ``var/slurm-up.txt``); with ``GPUPOOL_REQUIRE_SLURM=1`` (CI) they fail instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

SLURM_DIR = Path(os.environ.get("GPUPOOL_SLURM_DIR", "/var/lib/gpupool-slurm"))
SLURM_CONF = SLURM_DIR / "etc" / "slurm.conf"
OUTPUT_DIR = SLURM_DIR / "output"
NODE = socket.gethostname().split(".")[0]  # scripts/slurm-up: $(hostname -s)
NODE2 = f"{NODE}-2"
REASON_FILE = Path(__file__).resolve().parent.parent / "var" / "slurm-up.txt"


def slurm(*argv: str) -> str:
    """Run a Slurm command against the test cluster; its stdout."""
    done = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SLURM_CONF": str(SLURM_CONF)},
    )
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@pytest.fixture(scope="session")
def slurm_cluster() -> Path:
    """The cluster's slurm.conf; skips (or, in CI, fails) when the cluster does not answer."""
    reason = ""
    if not SLURM_CONF.exists():
        reason = f"there is no test Slurm cluster ({SLURM_CONF} is missing)"
    else:
        try:
            if "is UP" not in slurm("scontrol", "ping"):
                reason = "slurmctld is not up"
            elif not slurm("sinfo", "-h", "-o", "%T").strip().startswith(("idle", "mixed", "alloc", "compl")):
                reason = "the test cluster's node is not idle"
        except (AssertionError, OSError, subprocess.TimeoutExpired) as exc:
            reason = f"the test Slurm cluster does not answer ({exc})"
    if reason:
        if REASON_FILE.exists():
            reason += f"; scripts/slurm-up said: {REASON_FILE.read_text().strip()}"
        reason += " (run scripts/slurm-up as root)"
        if os.environ.get("GPUPOOL_REQUIRE_SLURM") == "1":
            pytest.fail(f"GPUPOOL_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    return SLURM_CONF


REST_URL = f"http://127.0.0.1:{os.environ.get('GPUPOOL_SLURMRESTD_PORT', '6830')}"


@pytest.fixture
def slurm_rest(slurm_cluster, tmp_path) -> tuple[str, Path]:
    """slurmrestd of the test cluster (``scripts/slurm-up`` starts it where the Debian package
    slurmrestd is installed) and a file holding a fresh token for root (``scontrol token``);
    skips (or, in CI, fails) when it does not answer."""
    import httpx

    reason = ""
    token = tmp_path / "slurm.jwt"
    try:
        token.write_text(slurm("scontrol", "token", "username=root", "lifespan=3600").strip())
        r = httpx.get(
            f"{REST_URL}/slurm/v0.0.38/ping",
            headers={"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token.read_text().split("=", 1)[1]},
            timeout=10,
        )
        if r.status_code != 200:
            reason = f"slurmrestd answered {r.status_code} at {REST_URL}"
    except (AssertionError, OSError, httpx.HTTPError) as exc:
        reason = f"slurmrestd does not answer at {REST_URL} ({exc}); install the Debian packages slurmrestd and slurm-wlm-jwt-plugin and run scripts/slurm-up"
    if reason:
        if os.environ.get("GPUPOOL_REQUIRE_SLURM") == "1":
            pytest.fail(f"GPUPOOL_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    return REST_URL, token
