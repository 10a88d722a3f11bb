"""The agent's SSH endpoint: a shell or a command inside a workload, for any image, sshd or not.

asyncssh serves it on ``ssh_listen`` (``host:port``; port 0: any free port) with a host key made
once and kept in the state directory (``ssh_host_ed25519_key``, 0600). The user name is the
workload's id (``ssh -p 2222 123@node``). Public-key authentication only: no password, no
keyboard-interactive, no host-based; no agent, X11 or port forwarding; no SFTP or SCP; the
client's environment requests are ignored.

Who may log in is the portal's answer at that moment: for each connection the agent asks it for
the keys of the named workload (``GET /agent/v1/nodes/<id>/workloads/<id>/ssh-keys``), parses
each key again, and accepts only those. The portal answers only while the workload runs on this
node; a portal that cannot be reached, or answers anything but the list, lets nobody in.

Sessions, as the client asks (a command on the ssh command line runs instead of a shell; a
terminal if it asks for one, resized as its window is):

- docker: ``docker exec`` into the workload's container (the Engine API, attached), so the session
  has the container's user, directory, environment and hardening; the exec's exit status is the
  session's;
- subprocess: a process as the workload's user, in its working directory with its environment,
  started as the runtime starts the workload itself (``SubprocessRuntime.session_options``);
- simulated: refused with a message: a simulated workload is a timer, with nothing to log in to.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pty
import signal
import socket
import struct
import subprocess
import termios
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncssh

from nodes.agent.runtimes import Runtime, RuntimeFailure
from nodes.agent.workload_rules import WorkloadRuleError, check_workload_id, parse_ssh_public_key

log = logging.getLogger(__name__)

HOST_KEY_FILE = "ssh_host_ed25519_key"
LOGIN_TIMEOUT_S = 30
# Logins being decided at once (each asks the portal): past this, a login is refused at once, so a
# flood of connections to the port cannot become a flood of requests to the portal.
MAX_PENDING_LOGINS = 16
# A shell: bash where the image has it, else sh; interactive when the session has a terminal.
SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; fi; exec sh"]

KeysSource = Callable[[str], Awaitable[list[str] | None]]


def parse_listen(text: str) -> tuple[str, int]:
    """``"0.0.0.0:2222"``, ``"[::]:2222"``, ``"127.0.0.1:0"`` -> (host, port); ValueError otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"ssh_listen must be host:port (port 0-65535), not {text!r}")
    return host.strip("[]"), int(port_text)


def load_host_key(state_dir: Path) -> asyncssh.SSHKey:
    """The endpoint's host key, made on first use and kept (0600) in the state directory."""
    path = state_dir / HOST_KEY_FILE
    if path.exists():
        return asyncssh.read_private_key(str(path))
    key = asyncssh.generate_private_key("ssh-ed25519")
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.export_private_key())
    os.replace(tmp, path)
    return key


def _exit_status(returncode: int | None) -> int:
    if returncode is None:
        return 255
    return returncode if returncode >= 0 else 128 - returncode


class SshEndpoint:
    def __init__(self, *, listen: str, state_dir: Path, runtime: Runtime, keys: KeysSource) -> None:
        self.host, self.port = parse_listen(listen)
        self.state_dir = state_dir
        self.runtime = runtime
        self.keys = keys
        self.host_key = load_host_key(state_dir)
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self._pending_logins = 0

    @property
    def public_host_key(self) -> str:
        """``ssh-ed25519 AAAA...``: for the portal to give tenants as a known_hosts line."""
        return self.host_key.convert_to_public().export_public_key().decode().split("\n")[0].strip()

    async def start(self) -> int:
        """Listen; answers the port (the one the system chose for port 0)."""
        self._acceptor = await asyncssh.create_server(
            lambda: _Server(self),
            self.host,
            self.port,
            server_host_keys=[self.host_key],
            process_factory=self._session,
            encoding=None,
            line_editor=False,
            allow_pty=True,
            agent_forwarding=False,
            x11_forwarding=False,
            allow_scp=False,
            sftp_factory=None,
            login_timeout=LOGIN_TIMEOUT_S,
        )
        self.port = self._acceptor.get_port()
        log.info("SSH endpoint listening on %s:%s", self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
            await self._acceptor.wait_closed()
            self._acceptor = None

    async def allowed_keys(self, username: str) -> set[bytes]:
        """The public keys that may log in as ``username`` now (the portal's answer, each parsed
        again); empty when the name is no workload id or the portal does not answer."""
        try:
            check_workload_id(username)
        except WorkloadRuleError:
            return set()
        if self._pending_logins >= MAX_PENDING_LOGINS:
            log.warning("SSH login to %s refused: %d logins already waiting", username, self._pending_logins)
            return set()
        self._pending_logins += 1
        try:
            lines = await self.keys(username)
        finally:
            self._pending_logins -= 1
        allowed: set[bytes] = set()
        for line in lines or ():
            try:
                allowed.add(asyncssh.import_public_key(parse_ssh_public_key(line).line).public_data)
            except (WorkloadRuleError, asyncssh.KeyImportError, ValueError):
                log.warning("the portal sent a key for %s that is not a valid public key", username)
        return allowed

    # -- sessions ---------------------------------------------------------------------------------

    async def _session(self, process: asyncssh.SSHServerProcess) -> None:
        workload_id = process.get_extra_info("username")
        try:
            if process.subsystem:
                raise RuntimeFailure(f"the {process.subsystem} subsystem is not served here")
            argv = ["/bin/sh", "-c", process.command] if process.command else SHELL
            term = process.get_terminal_type()
            width, height = process.get_terminal_size()[:2]
            if hasattr(self.runtime, "exec_open"):
                status = await self._docker_session(process, workload_id, argv, term, width, height)
            elif hasattr(self.runtime, "session_options"):
                status = await self._process_session(process, workload_id, argv, term, width, height)
            else:
                raise RuntimeFailure(
                    f"SSH is not available on the {self.runtime.name} runtime: a simulated workload "
                    "is a timer, with no shell to log in to"
                )
        except RuntimeFailure as exc:
            process.stderr.write(f"gpupool: {exc}\r\n".encode())
            status = 1
        except (OSError, asyncssh.Error) as exc:
            log.warning("SSH session into %s failed: %r", workload_id, exc)
            status = 255
        process.exit(status)

    async def _docker_session(
        self, process: Any, workload_id: str, argv: list[str], term: str | None, width: int, height: int
    ) -> int:
        runtime: Any = self.runtime
        env = {"TERM": term} if term else {}
        exec_id, sock = await asyncio.to_thread(runtime.exec_open, workload_id, argv, tty=bool(term), env=env)
        reader, writer = await asyncio.open_connection(sock=sock)
        if term and width and height:
            await asyncio.to_thread(runtime.exec_resize, exec_id, width, height)

        async def resize(w: int, h: int) -> None:
            await asyncio.to_thread(runtime.exec_resize, exec_id, w, h)

        async def write(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        def eof() -> None:
            if term:  # on a terminal, end of input is ^D (docker ends a TTY exec's stream at a half-close)
                writer.write(b"\x04")
            elif writer.can_write_eof():
                writer.write_eof()

        feeding = asyncio.ensure_future(_feed(process, write, eof, resize))
        try:
            if term:
                while data := await reader.read(65536):
                    process.stdout.write(data)
            else:  # docker's frames: stream (1 stdout, 2 stderr), 3 zero bytes, big-endian length
                while True:
                    try:
                        header = await reader.readexactly(8)
                        payload = await reader.readexactly(int.from_bytes(header[4:8], "big"))
                    except asyncio.IncompleteReadError:
                        break
                    (process.stderr if header[0] == 2 else process.stdout).write(payload)
        finally:
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeding
            writer.close()
        return _exit_status(await asyncio.to_thread(runtime.exec_exit_code, exec_id))

    async def _process_session(
        self, process: Any, workload_id: str, argv: list[str], term: str | None, width: int, height: int
    ) -> int:
        runtime: Any = self.runtime
        options = runtime.session_options(workload_id, term)
        # subprocess.Popen itself (not the event loop's subprocess API, which uvloop narrows): the
        # session starts exactly as the workload's command did. Its ends are sockets or a terminal.
        if not term:
            pairs = [socket.socketpair() for _ in range(3)]  # stdin, stdout, stderr: (ours, its)
            try:
                proc = subprocess.Popen(
                    argv, stdin=pairs[0][1], stdout=pairs[1][1], stderr=pairs[2][1], **options
                )
            except OSError as exc:
                for ours, its in pairs:
                    ours.close()
                    its.close()
                raise RuntimeFailure(f"cannot start a shell: {exc}") from exc
            for _, its in pairs:
                its.close()
            runtime.session_started(workload_id, proc.pid)
            # Each (reader, writer) is kept: a writer that is garbage collected closes its socket.
            streams = [await asyncio.open_connection(sock=ours) for ours, _ in pairs]
            stdin, stdout, stderr = streams[0][1], streams[1][0], streams[2][0]

            async def write(data: bytes) -> None:
                stdin.write(data)
                await stdin.drain()

            def eof() -> None:
                if stdin.can_write_eof():
                    stdin.write_eof()

            async def no_resize(w: int, h: int) -> None:
                return None

            feeding = asyncio.ensure_future(_feed(process, write, eof, no_resize))
            try:
                await asyncio.gather(_copy(stdout, process.stdout.write), _copy(stderr, process.stderr.write))
                return _exit_status(await asyncio.to_thread(proc.wait))
            finally:
                feeding.cancel()
                for _, writer in streams:
                    writer.close()
                _end(proc)
                runtime.session_ended(workload_id, proc.pid)
        master, slave = pty.openpty()
        _set_size(master, width, height)
        try:
            proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, **options)
        except OSError as exc:
            os.close(master)
            raise RuntimeFailure(f"cannot start a shell: {exc}") from exc
        finally:
            os.close(slave)
        runtime.session_started(workload_id, proc.pid)

        async def pty_write(data: bytes) -> None:
            await asyncio.to_thread(os.write, master, data)

        async def pty_resize(w: int, h: int) -> None:
            _set_size(master, w, h)

        def pty_eof() -> None:
            with contextlib.suppress(OSError):
                os.write(master, b"\x04")  # ^D: end of input on a terminal

        feeding = asyncio.ensure_future(_feed(process, pty_write, pty_eof, pty_resize))
        try:
            while True:
                try:
                    data = await asyncio.to_thread(os.read, master, 65536)
                except OSError:  # EIO: every process holding the terminal has gone
                    break
                if not data:
                    break
                process.stdout.write(data)
            return _exit_status(await asyncio.to_thread(proc.wait))
        finally:
            feeding.cancel()
            _end(proc)
            os.close(master)
            runtime.session_ended(workload_id, proc.pid)


async def _feed(
    process: Any,
    write: Callable[[bytes], Awaitable[None]],
    eof: Callable[[], Any],
    resize: Callable[[int, int], Awaitable[None]],
) -> None:
    """The client's input into the session, window changes as resizes, its end as end of input."""
    try:
        while True:
            try:
                data = await process.stdin.read(65536)
            except asyncssh.TerminalSizeChanged as change:
                await resize(change.width, change.height)
                continue
            if not data:
                break
            await write(data)
        eof()
    except (OSError, asyncssh.Error):
        pass


async def _copy(stream: asyncio.StreamReader, write: Callable[[bytes], Any]) -> None:
    while data := await stream.read(65536):
        write(data)


def _set_size(fd: int, width: int, height: int) -> None:
    if width and height:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))


def _end(proc: subprocess.Popen[bytes]) -> None:
    """A session's processes go when it ends (the client left): its whole process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


class _Server(asyncssh.SSHServer):
    """One connection: public keys only, checked against the portal's answer for the user name."""

    def __init__(self, endpoint: SshEndpoint) -> None:
        self.endpoint = endpoint
        self.allowed: set[bytes] = set()
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    async def begin_auth(self, username: str) -> bool:
        self.allowed = await self.endpoint.allowed_keys(username)
        if not self.allowed and self.conn is not None:
            self.conn.send_auth_banner(
                f"gpupool: {username!r} is no running workload of this node that your keys open.\r\n"
            )
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return key.public_data in self.allowed
