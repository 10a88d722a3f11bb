"""``gpupool run --wait`` as its own process against the live portal: on a terminal (a real pty on
stderr) it shows the workload's state and why it waits as it changes; in a pipe it says nothing
but the one line of what it submitted."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
import time

import pytest
from django.db import connections

from scheduling.models import Workload
from scheduling.services.lifecycle import workload_on_running
from tests.client.conftest import ROOT
from tests.scheduling.conftest import H100

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _gpupool_env(gp, tmp_path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT / "client" / "src"),
        "GPUPOOL_URL": gp.url,
        "GPUPOOL_TOKEN": gp.token,
        "GPUPOOL_CONFIG_DIR": str(tmp_path / "config"),
        "GPUPOOL_NO_KEYRING": "1",
        "GPUPOOL_WAIT_POLL_S": "0.1",
        "TERM": "xterm-256color",
        "COLUMNS": "120",
    }


def _start_when_submitted(tenant, node, cycle, before: set[int], hold_s: float) -> threading.Thread:
    """The node's side: once the command has submitted its job, it stays pending ``hold_s``, then
    is placed and runs."""

    def agent():
        try:
            for _ in range(400):
                w = Workload.objects.filter(tenant=tenant).exclude(pk__in=before).first()
                if w is not None:
                    break
                time.sleep(0.05)
            time.sleep(hold_s)
            cycle()
            workload_on_running(node_id=node.pk, workload_id=w.pk)
        finally:
            connections.close_all()

    thread = threading.Thread(target=agent)
    thread.start()
    return thread


ARGS = ["-m", "gpupool", "run", "--wait", "running", "--gpus", "1", "--model", H100, "--image", "img:1",
        "--", "python", "train.py"]  # fmt: skip


def test_a_wait_shows_progress_on_a_terminal_and_is_quiet_in_a_pipe(gp, tenant, make_node, cycle, tmp_path):
    node = make_node(H100, gpus=8)
    env = _gpupool_env(gp, tmp_path)

    # On a terminal: stderr is a pty, read as a terminal would show it.
    agent = _start_when_submitted(tenant, node, cycle, set(), hold_s=1.0)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, *ARGS], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=slave, env=env, cwd=tmp_path)  # fmt: skip
    finally:
        os.close(slave)
    shown = bytearray()

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the pty's other end closed
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        agent.join()
        reader.join(timeout=10)
        os.close(master)
    job = Workload.objects.get(tenant=tenant)
    text = shown.decode("utf-8", "replace")
    assert proc.returncode == 0, text
    assert out.decode().split() == [str(job.pk), "running"]  # stdout: only the answer
    assert f"job {job.pk}: pending" in text, text  # the state while it waits...
    assert "\x1b[" in text  # ... redrawn in place (a spinner), not printed line after line

    # In a pipe: the submitted line, and no progress at all.
    before = {job.pk}
    agent = _start_when_submitted(tenant, node, cycle, before, hold_s=1.0)
    try:
        piped = subprocess.run([sys.executable, *ARGS], stdin=subprocess.DEVNULL, capture_output=True,
                               env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    finally:
        agent.join()
    second = Workload.objects.filter(tenant=tenant).exclude(pk__in=before).get()
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.decode().split() == [str(second.pk), "running"]
    assert piped.stderr.decode() == f"job {second.pk} submitted (pending)\n"
