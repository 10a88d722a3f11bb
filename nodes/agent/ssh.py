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

Open sessions follow the same answer: every ``recheck_s`` seconds the endpoint asks again for each
workload it has connections to, and disconnects each connection whose key is no longer among the
keys (a deleted key, a member removed or deactivated) or whose workload no longer runs here (the
portal's 404: an empty list). A portal that does not answer leaves open sessions as they are (a
portal outage does not cut everyone off); a stop or preemption of the workload closes its
connections at once (``close_workload``). When a connection goes, for whatever reason, the process
its session started goes with it: the subprocess runtime's process group is killed, the docker
runtime's exec is killed (``DockerRuntime.exec_kill``).

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

# The keys that may log in to a workload now: a list (empty: nobody, the workload does not run
# here), or None when the portal gave no answer (unreachable, an error).
KeysSource = Callable[[str], Awaitable[list[str] | None]]
DEFAULT_RECHECK_S = 15.0


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


def _parse_keys(workload_id: str, lines: Any) -> set[bytes]:
    """The portal's key lines, each parsed again, as the public key data a login compares."""
    allowed: set[bytes] = set()
    for line in lines:
        try:
            allowed.add(asyncssh.import_public_key(parse_ssh_public_key(line).line).public_data)
        except (WorkloadRuleError, asyncssh.KeyImportError, ValueError):
            log.warning("the portal sent a key for %s that is not a valid public key", workload_id)
    return allowed


def _exit_status(returncode: int | None) -> int:
    if returncode is None:
        return 255
    return returncode if returncode >= 0 else 128 - returncode


class SshEndpoint:
    def __init__(
        self,
        *,
        listen: str,
        state_dir: Path,
        runtime: Runtime,
        keys: KeysSource,
        recheck_s: float = DEFAULT_RECHECK_S,
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self.state_dir = state_dir
        self.runtime = runtime
        self.keys = keys
        self.recheck_s = recheck_s
        self.host_key = load_host_key(state_dir)
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self._pending_logins = 0
        self._connections: set[_Server] = set()  # logged in and not yet gone
        self._sessions: dict[Any, set[Any]] = {}  # connection -> its open sessions (processes)
        self._recheck: asyncio.Task[None] | None = None

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
        self._recheck = asyncio.ensure_future(self._recheck_loop())
        log.info("SSH endpoint listening on %s:%s", self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recheck
            self._recheck = None
        for server in list(self._connections):
            server.disconnect("gpupool: the node's agent is shutting down")
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
        return _parse_keys(username, lines or ())

    # -- open connections follow the portal's answer -----------------------------------------------

    def connections(self, workload_id: str | None = None) -> int:
        """How many logged-in connections are open (to ``workload_id``, or to any workload)."""
        return sum(1 for s in self._connections if workload_id is None or s.username == workload_id)

    def close_workload(self, workload_id: str, reason: str = "gpupool: the workload is stopping") -> int:
        """Disconnect every connection to ``workload_id`` (it stops); answers how many."""
        servers = [s for s in self._connections if s.username == workload_id]
        for server in servers:
            server.disconnect(reason)
        return len(servers)

    async def recheck(self) -> int:
        """Ask the portal again for the keys of each workload with open connections and disconnect
        those whose key is no longer allowed; answers how many were disconnected."""
        by_workload: dict[str, list[_Server]] = {}
        for server in self._connections:
            by_workload.setdefault(server.username, []).append(server)
        closed = 0
        for workload_id, servers in by_workload.items():
            lines = await self.keys(workload_id)
            if lines is None:  # no answer: sessions stay as they are until the portal answers
                continue
            allowed = _parse_keys(workload_id, lines)
            for server in servers:
                if server.key not in allowed:
                    log.info("SSH session into %s closed: its key no longer opens it", workload_id)
                    server.disconnect(f"gpupool: your access to workload {workload_id} has ended")
                    closed += 1
        return closed

    async def _recheck_loop(self) -> None:
        while True:
            await asyncio.sleep(self.recheck_s)
            if not self._connections:
                continue
            try:
                await self.recheck()
            except Exception:  # the next round tries again; the loop must not die
                log.exception("SSH session recheck failed")

    # -- sessions ---------------------------------------------------------------------------------

    async def _session(self, process: asyncssh.SSHServerProcess) -> None:
        """Run the session until it ends or its channel closes (the client left, or it was
        disconnected): then the session's process is ended as well (the body's ``finally``)."""
        conn = process.get_extra_info("connection")
        self._sessions.setdefault(conn, set()).add(process)
        body = asyncio.ensure_future(self._session_body(process))
        gone = asyncio.ensure_future(process.channel.wait_closed())
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sessions = self._sessions.get(conn)
            if sessions is not None:
                sessions.discard(process)
                if not sessions:
                    del self._sessions[conn]
            if not body.done():
                body.cancel()
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await body
            with contextlib.suppress(asyncio.CancelledError):
                await gone

    async def _session_body(self, process: asyncssh.SSHServerProcess) -> None:
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
            # Ended, or the client went: docker keeps an exec running when its stream closes.
            await asyncio.to_thread(runtime.exec_kill, exec_id)
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
        with contextlib.suppress(subprocess.TimeoutExpired):  # reaped: killed, it goes at once
            proc.wait(timeout=2)


class _Server(asyncssh.SSHServer):
    """One connection: public keys only, checked against the portal's answer for the user name."""

    def __init__(self, endpoint: SshEndpoint) -> None:
        self.endpoint = endpoint
        self.allowed: set[bytes] = set()
        self.conn: asyncssh.SSHServerConnection | None = None
        self.username = ""
        self.key = b""  # the key this connection logged in with (its public data)
        self._last_valid = b""

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint._connections.discard(self)

    def auth_completed(self) -> None:
        # The last key found valid is the one whose signature completed the login.
        self.key = self._last_valid
        self.endpoint._connections.add(self)

    def disconnect(self, reason: str) -> None:
        """Close the connection; its sessions read ``reason`` on stderr first (a client may not
        show the disconnect message itself)."""
        self.endpoint._connections.discard(self)
        if self.conn is None:
            return
        for process in self.endpoint._sessions.get(self.conn, ()):
            with contextlib.suppress(Exception):  # a channel already closing
                process.stderr.write(f"{reason}\r\n".encode())
        self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, reason)

    async def begin_auth(self, username: str) -> bool:
        self.username = username
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
        if key.public_data in self.allowed:
            self._last_valid = key.public_data
            return True
        return False
