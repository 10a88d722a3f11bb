"""The firewall rules that close a docker gang's rendezvous port to everyone but its members.

Rank 0 publishes ``MASTER_PORT`` on its node's address (``MASTER_ADDR``); the engine forwards a
published port from anywhere, other tenants' containers on the same node included (they reach the
node's address through the engine's proxy or its DNAT rule). So every member's agent adds rules,
tagged with the member (``gpupool-gang-<id>-rank<k>``), to a chain of its own, ``GPUPOOL-GANGS``,
which ``INPUT`` (the engine's proxy) and ``DOCKER-USER`` (forwarded traffic, before the engine's
own rules) jump to. For a new connection whose original destination was ``MASTER_ADDR:MASTER_PORT``:

- from the gang's own network (its subnet on this node): accepted (goes on to the engine's rules);
- on rank 0's node, from a peer node's address (``GPUPOOL_PEERS``: the other members' traffic
  leaves their nodes masqueraded as the node): accepted;
- anything else: dropped. On a peer node this is the other tenants' containers, whose traffic would
  otherwise leave masqueraded as that node, from an address rank 0 accepts.

And one more: a new connection from the gang's network to any address of the node itself (the
agent's SSH endpoint, anything else listening there) is dropped, but the rendezvous above.

The rules go with the member (``remove``), and are made before its container starts, so there is no
moment when the port is open. IPv4 only (``iptables``); values are checked IP addresses, ports and
tags, passed as argv, never through a shell.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import threading

from nodes.agent.runtimes import RuntimeFailure

CHAIN = "GPUPOOL-GANGS"
HOOKS = ("INPUT", "DOCKER-USER")
TAG = re.compile(r"^gpupool-gang-[A-Za-z0-9_.-]{1,64}-rank[0-9]{1,4}$")
_lock = threading.Lock()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("iptables")
    if binary is None:
        raise RuntimeFailure("the gang's firewall rules need iptables, which is missing on this node")
    # -w: wait for the xtables lock (the engine changes rules too).
    try:
        done = subprocess.run(
            [binary, "-w", "5", *argv], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailure(f"iptables {' '.join(argv)} failed: {exc}") from None
    if check and done.returncode != 0:
        raise RuntimeFailure(f"iptables {' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def _ensure_chain() -> None:
    if _run("-S", "DOCKER-USER", check=False).returncode != 0:
        # No engine chain here: not the host's network namespace (a pod without hostNetwork), or
        # dockerd runs without its iptables rules. Rules made here would protect nothing.
        raise RuntimeFailure(
            "the gang's firewall rules need dockerd's DOCKER-USER chain, which this agent does not "
            "see: run it in the host's network namespace with CAP_NET_ADMIN, dockerd with iptables on"
        )
    if _run("-S", CHAIN, check=False).returncode != 0:
        _run("-N", CHAIN, check=False)  # another agent of this host may make it at the same moment
        _run("-S", CHAIN)
    for hook in HOOKS:
        if _run("-C", hook, "-j", CHAIN, check=False).returncode != 0:
            _run("-I", hook, "1", "-j", CHAIN)


def _v4(value: str, what: str) -> str:
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise RuntimeFailure(
            f"{what} {value!r} is not an IP address (the gang's firewall needs one)"
        ) from None
    if address.version != 4:
        raise RuntimeFailure(f"{what} {value}: docker gangs' firewall rules are IPv4 only")
    return str(address)


def rules(
    *, tag: str, master_addr: str, port: int, subnet: str, peers: list[str], rank0: bool
) -> list[list[str]]:
    """The member's rules, in order (each without the ``-A CHAIN``)."""
    if not TAG.match(tag):
        raise RuntimeFailure(f"not a gang rule tag: {tag!r}")
    if not 1 <= port <= 65535:
        raise RuntimeFailure(f"not a port: {port}")
    master = _v4(master_addr, "MASTER_ADDR")
    network = str(ipaddress.ip_network(subnet, strict=False))
    match = ["-p", "tcp", "-m", "conntrack", "--ctorigdst", master, "--ctorigdstport", str(port)]
    comment = ["-m", "comment", "--comment", tag]
    allowed = [network]
    if rank0:
        allowed += sorted({_v4(p, "a peer's address") for p in peers})
    out = [["-s", source, *match, *comment, "-j", "RETURN"] for source in allowed]
    out.append([*match, "-m", "conntrack", "--ctstate", "NEW", *comment, "-j", "DROP"])
    # The node itself: nothing from the gang's network but the rendezvous (returned above).
    local = ["-m", "addrtype", "--dst-type", "LOCAL", "-m", "conntrack", "--ctstate", "NEW"]
    out.append(["-s", network, *local, *comment, "-j", "DROP"])
    return out


def add(*, tag: str, master_addr: str, port: int, subnet: str, peers: list[str], rank0: bool) -> None:
    """Add the member's rules (its earlier ones go first: a start tried again)."""
    wanted = rules(tag=tag, master_addr=master_addr, port=port, subnet=subnet, peers=peers, rank0=rank0)
    with _lock:
        _ensure_chain()
        _remove_locked(tag)
        for rule in wanted:
            _run("-A", CHAIN, *rule)


def remove(tag: str) -> None:
    """Remove the member's rules, whatever is left of them."""
    if not TAG.match(tag) or shutil.which("iptables") is None:
        return
    with _lock:
        _remove_locked(tag)


def _remove_locked(tag: str) -> None:
    listed = _run("-S", CHAIN, check=False)
    if listed.returncode != 0:
        return
    for line in listed.stdout.splitlines():
        parts = line.split()
        if parts[:2] == ["-A", CHAIN] and _tag_of(parts) == tag:
            _run("-D", CHAIN, *parts[2:], check=False)


def _tag_of(parts: list[str]) -> str | None:
    for i, part in enumerate(parts[:-1]):
        if part == "--comment":
            return parts[i + 1].strip('"')
    return None


def listed(tag: str) -> list[str]:
    """The member's rules as ``iptables -S`` prints them (for tests and diagnostics)."""
    done = _run("-S", CHAIN, check=False)
    if done.returncode != 0:
        return []
    return [line for line in done.stdout.splitlines() if _tag_of(line.split()) == tag]
