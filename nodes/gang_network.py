"""A region's gang network: the checks its three settings must pass (staff pages, the admin, the
cycle before it hands out an address). Plain Python: the agent has its own copy of the rules for
the payload it receives (``nodes.agent.workload_rules.check_gang_network``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


class GangNetworkError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True, slots=True)
class GangNetwork:
    subnet: ipaddress.IPv4Network
    range: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address | None

    def hosts(self) -> list[str]:
        """The addresses members may get: the range's hosts, without the gateway (the engine's
        network has one, so without the region's it is the subnet's first address)."""
        gateway = self.gateway or next(self.subnet.hosts())
        return [str(a) for a in self.range.hosts() if a != gateway]


def gang_network_check(*, subnet: str, range_: str, gateway: str | None) -> GangNetwork | None:
    """The network the three settings describe, None when the region has none (all empty);
    raises :class:`GangNetworkError` naming the field otherwise."""
    if not subnet and not range_ and not gateway:
        return None
    if not subnet or not range_:
        raise GangNetworkError("gang_subnet" if not subnet else "gang_range", "Set both, or neither.")
    nets = {}
    for field, value in (("gang_subnet", subnet), ("gang_range", range_)):
        try:
            net = ipaddress.ip_network(value, strict=True)
        except ValueError:
            raise GangNetworkError(field, f"{value!r} is not an IPv4 network in CIDR form.") from None
        if net.version != 4:
            raise GangNetworkError(field, "IPv4 only.")
        if net.is_loopback or net.is_link_local or net.is_multicast:
            raise GangNetworkError(field, "Not a loopback, link-local or multicast network.")
        nets[field] = net
    if not nets["gang_range"].subnet_of(nets["gang_subnet"]):
        raise GangNetworkError("gang_range", "Must lie within gang_subnet.")
    if nets["gang_range"].num_addresses < 4:
        raise GangNetworkError("gang_range", "Too small: a /30 or larger.")
    gw = None
    if gateway:
        try:
            gw = ipaddress.IPv4Address(gateway)
        except ValueError:
            raise GangNetworkError("gang_gateway", f"{gateway!r} is not an IPv4 address.") from None
        if gw not in nets["gang_subnet"]:
            raise GangNetworkError("gang_gateway", "Must lie within gang_subnet.")
    return GangNetwork(subnet=nets["gang_subnet"], range=nets["gang_range"], gateway=gw)
