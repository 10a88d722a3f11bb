"""The agent's SSH endpoint on its own (``nodes/agent/ssh.py``), with a real ``ssh`` client: its host
key is made once and kept, only public keys that the key source names open it, a key source that
does not answer lets nobody in, the simulated runtime refuses with a message, and ``ssh_listen`` is
checked like any setting. Logins through the real portal are in ``tests/nodes/test_ssh_e2e.py``."""

from __future__ import annotations

import asyncio
import stat
import subprocess
from pathlib import Path

import pytest

from nodes.agent.config import ConfigError, load_config
from nodes.agent.runtimes.simulated import SimulatedRuntime
from nodes.agent.ssh import HOST_KEY_FILE, SshEndpoint
from nodes.agent.types import WorkloadSpec
from tests.agent.conftest import process_options  # noqa: F401  (a fixture)
from tests.ssh_keys import key_pair


def _ssh(port: int, key_file: Path, user: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-i", str(key_file), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
         *options, "-p", str(port), f"{user}@127.0.0.1", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _key_file(tmp_path: Path, name: str) -> tuple[Path, str]:
    private, public = key_pair(comment=name)
    path = tmp_path / name
    path.write_bytes(private)
    path.chmod(0o600)
    return path, public


def _serve(tmp_path: Path, answers: dict[str, list[str] | None], asked: list[str]):
    runtime = SimulatedRuntime(tmp_path / "state")
    runtime.start(WorkloadSpec(workload_id="7", image="ghcr.io/acme/x:1"))

    async def keys(workload_id: str) -> list[str] | None:
        asked.append(workload_id)
        return answers.get(workload_id)

    return runtime, keys


def test_only_the_named_keys_open_it_and_the_simulated_runtime_says_why_not(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    good, good_public = _key_file(tmp_path, "good")
    other, _ = _key_file(tmp_path, "other")
    asked: list[str] = []
    runtime, keys = _serve(tmp_path, {"7": [good_public], "8": None}, asked)

    async def scenario() -> dict[str, subprocess.CompletedProcess[str]]:
        endpoint = SshEndpoint(listen="127.0.0.1:0", state_dir=tmp_path / "state", runtime=runtime, keys=keys)
        port = await endpoint.start()
        try:
            runs = {}
            for name, key, user, options in (
                ("good", good, "7", ()),
                ("other", other, "7", ()),
                ("unreachable", good, "8", ()),
                ("not-an-id", good, "../7", ()),
                ("password", good, "7", ("-o", "PubkeyAuthentication=no", "-o", "BatchMode=yes")),
            ):
                runs[name] = await asyncio.to_thread(_ssh, port, key, user, *options)
            return runs
        finally:
            await endpoint.close()

    runs = asyncio.run(scenario())
    # The right key gets in, and is told the simulated runtime has no shell.
    assert runs["good"].returncode == 1, runs["good"]
    assert "SSH is not available on the simulated runtime" in runs["good"].stderr
    for name in ("other", "unreachable", "not-an-id", "password"):
        assert runs[name].returncode == 255 and "Permission denied" in runs[name].stderr, (name, runs[name])
    assert "publickey" in runs["password"].stderr and "password" not in runs["password"].stderr.split("(")[-1]
    # The portal is asked at every login (no cache); a name that is no workload id is not asked.
    assert asked.count("7") == 3 and asked.count("8") == 1 and "../7" not in asked


def test_the_host_key_is_made_once_and_kept_private(tmp_path: Path) -> None:
    runtime = SimulatedRuntime(tmp_path)

    async def no_keys(workload_id: str) -> list[str] | None:
        return None

    first = SshEndpoint(listen="127.0.0.1:0", state_dir=tmp_path, runtime=runtime, keys=no_keys)
    again = SshEndpoint(listen="127.0.0.1:0", state_dir=tmp_path, runtime=runtime, keys=no_keys)
    assert first.public_host_key == again.public_host_key
    assert first.public_host_key.startswith("ssh-ed25519 ") and len(first.public_host_key.split()) == 2
    assert stat.S_IMODE((tmp_path / HOST_KEY_FILE).stat().st_mode) == 0o600


@pytest.mark.parametrize("value", ["2222", "host:", ":22", "0.0.0.0:70000", "0.0.0.0:ssh"])
def test_a_bad_ssh_listen_is_a_configuration_error(value: str) -> None:
    base = {"GPUPOOL_PORTAL_URL": "https://portal.example", "GPUPOOL_RUNTIME": "simulated"}
    assert load_config(env={**base, "GPUPOOL_SSH_LISTEN": "[::]:2222"}).validate().ssh_listen == "[::]:2222"
    with pytest.raises(ConfigError, match="ssh_listen"):
        load_config(env={**base, "GPUPOOL_SSH_LISTEN": value}).validate()


def test_open_sessions_survive_a_silent_portal_and_end_when_it_says_no(
    tmp_path: Path,
    process_options,  # noqa: F811
) -> None:
    """The recheck (every 0.2 s here): no answer (None) leaves an open session alone; an answer
    without its key ends it, and the session's process with it."""
    from nodes.agent.runtimes.process import SubprocessRuntime

    key, public = _key_file(tmp_path, "k")
    runtime = SubprocessRuntime(tmp_path / "state", **process_options)
    runtime.start(WorkloadSpec(workload_id="5", image="ghcr.io/acme/x:1", command=["/bin/sleep", "600"]))
    answers: dict[str, list[str] | None] = {"5": [public]}

    async def keys(workload_id: str) -> list[str] | None:
        return answers.get(workload_id)

    async def scenario() -> tuple[bool, int | None, str]:
        endpoint = SshEndpoint(
            listen="127.0.0.1:0", state_dir=tmp_path / "state", runtime=runtime, keys=keys, recheck_s=0.2
        )
        port = await endpoint.start()
        client = subprocess.Popen(
            ["ssh", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "-T", "-p", str(port),
             "5@127.0.0.1", "echo ready; exec sleep 600"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert await asyncio.to_thread(client.stdout.readline) == "ready\n"
            assert endpoint.connections("5") == 1
            answers["5"] = None  # the portal does not answer
            await asyncio.sleep(1.0)
            alive = client.poll() is None and endpoint.connections("5") == 1
            answers["5"] = []  # the portal: not running here, nobody
            code = await asyncio.to_thread(client.wait, 10)
            return alive, code, await asyncio.to_thread(client.stderr.read)
        finally:
            if client.poll() is None:
                client.kill()
            client.wait()
            for stream in (client.stdin, client.stdout, client.stderr):
                stream.close()
            await endpoint.close()

    try:
        alive, code, stderr = asyncio.run(scenario())
    finally:
        runtime.stop("5", grace_s=0.5)
    assert alive
    assert code == 255 and "access to workload 5 has ended" in stderr, stderr
