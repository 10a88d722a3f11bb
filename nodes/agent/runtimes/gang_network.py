"""Gang members with addresses of their own on the region's gang network (docker runtime).

Where the region has a gang network (staff set its subnet and the range reserved for containers)
and this agent knows the interface that leads to it (``gang_parent``), each member of a gang gets
the address the portal handed it, on a macvlan network of the engine's on that interface
(``gpupool-gangs``, made once, labelled ``gpupool.gang_network``). Its peers on other hosts reach
it there directly, so NCCL's and Gloo's own connections after the rendezvous work as on bare
metal. A macvlan child cannot reach its own host (the kernel does not pass traffic between a
macvlan and its parent): the node stays closed to the gang.

The host's iptables never see a macvlan child's traffic, so the rules are made inside the
member's network namespace: a sandbox container holds it (``gpupool-<id>-rank<k>-net``, the
agent's ``gang_sandbox_image``, hardened and idle), the agent sets the rules there with ``nsenter``
before the tenant's container joins it (``--network container:<sandbox>``), and the tenant's
process, with every capability dropped, cannot change them:

- in: loopback, replies, and new connections from the gang's peers (``GPUPOOL_PEERS``); nothing
  else (other tenants' members on the same network, any other host on it);
- out: loopback, replies, the peers; not the link-local metadata addresses, not the rest of the
  gang subnet (other nodes, other gangs); the rest by the route out (the region's gateway; a region
  without one: nothing else).

IPv6 is off in the namespace (a sysctl of the sandbox). Values are checked IPv4 addresses and
networks, passed to ``iptables`` as argv, never through a shell.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess

from nodes.agent.runtimes import RuntimeFailure

NETWORK_NAME = "gpupool-gangs"
NETWORK_LABEL = "gpupool.gang_network"
SANDBOX_ROLE = "gpupool.role"
DEFAULT_SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"
# Link-local metadata addresses (clouds'), and Azure's wire server: the node-level rule in
# DOCKER-USER does not see a macvlan child's traffic, so the namespace drops them itself.
METADATA = ("169.254.0.0/16", "168.63.129.16/32")


def peers_checked(*, peers: str, address: str, subnet: str, rank: int) -> list[str]:
    """``GPUPOOL_PEERS``'s addresses, each an IPv4 address in ``subnet``, with the member's own
    ``address`` at its rank; raises :class:`RuntimeFailure` otherwise (before anything is made)."""
    net = ipaddress.IPv4Network(subnet)
    out = []
    for part in peers.split(","):
        try:
            peer = ipaddress.IPv4Address(part)
        except ValueError:
            raise RuntimeFailure(f"GPUPOOL_PEERS: {part!r} is not an IPv4 address") from None
        if peer not in net:
            raise RuntimeFailure(f"GPUPOOL_PEERS: {peer} is not on the gang network {net}")
        out.append(str(peer))
    if rank >= len(out) or out[rank] != address:
        raise RuntimeFailure("gang_network: the member's address is not its rank's in GPUPOOL_PEERS")
    return out


def rules(*, address: str, peers: list[str], subnet: str, route_out: bool = True) -> list[list[str]]:
    """The member's rules, in order, each an ``iptables`` argv after ``-A``; without
    ``route_out`` (the region has no gateway) nothing but the peers, out."""
    others = [p for p in peers if p != address]
    ipaddress.IPv4Network(subnet)  # checked by the caller; a bad one must not reach iptables
    replies = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    out = [["INPUT", "-i", "lo", "-j", "ACCEPT"], ["INPUT", *replies]]
    out += [["INPUT", "-s", peer, "-j", "ACCEPT"] for peer in others]
    out.append(["INPUT", "-j", "DROP"])
    out += [["OUTPUT", "-o", "lo", "-j", "ACCEPT"], ["OUTPUT", *replies]]
    out += [["OUTPUT", "-d", peer, "-j", "ACCEPT"] for peer in others]
    out += [["OUTPUT", "-d", net, "-j", "DROP"] for net in (*METADATA, subnet)]
    if not route_out:
        out.append(["OUTPUT", "-j", "DROP"])
    return out


def _iptables(pid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    nsenter, iptables = shutil.which("nsenter"), shutil.which("iptables")
    if nsenter is None or iptables is None:
        raise RuntimeFailure("a gang member's rules need nsenter and iptables, missing on this node")
    try:
        done = subprocess.run(
            [nsenter, "--target", str(pid), "--net", "--", iptables, "-w", "5", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailure(f"iptables {' '.join(argv)} in the member's namespace failed: {exc}") from None
    if done.returncode != 0:
        raise RuntimeFailure(
            f"iptables {' '.join(argv)} in the member's namespace failed: {done.stderr.strip()} "
            "(the agent needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN, in the host's PID namespace)"
        )
    return done


def apply(pid: int, wanted: list[list[str]]) -> None:
    """Set the rules in the namespace of process ``pid`` (the sandbox's), from empty chains."""
    if pid <= 0:
        raise RuntimeFailure("the gang member's sandbox is not running")
    for chain in ("INPUT", "OUTPUT"):
        _iptables(pid, "-F", chain)
    for rule in wanted:
        _iptables(pid, "-A", *rule)


def listed(pid: int) -> list[str]:
    """The namespace's rules as ``iptables -S`` prints them (for tests and diagnostics)."""
    return _iptables(pid, "-S").stdout.splitlines()
