"""Hosts behind NAT: a router namespace per host between it and the switch.

    <tag>-sw --p<i>-- wan [<tag>-r<i>] lan --- eth0 [<tag>-h<i>]
                  10.A.B.i           192.168.i.1   192.168.i.2

The router forwards and masquerades what the host sends out of `wan` (nftables), and holds
no port open for it: a packet from outside reaches the host only as part of a flow the host
began, as at home behind a consumer router. Kinds (NAT_KINDS):
  * preserve: `masquerade`, which keeps the host's source port when it is free (the common
    home router: a peer that learns the mapping can often punch through);
  * random: `masquerade random`, a fresh random port for every flow (a symmetric NAT, as
    carrier-grade NATs and some firewalls are: nobody can predict the mapping).
Filtering is Linux conntrack's: a reply must come from the address and port the flow went to.
The host's link (rate, delay, loss) applies between it and its router, so a NATed host's
link is shaped like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from netlab.links import HOST_IFACE, run

if TYPE_CHECKING:
    from netlab.topology import Host

NAT_KINDS = ("preserve", "random")
LAN_IFACE, WAN_IFACE = "lan", "wan"


def nat_rules(kind: str) -> str:
    if kind not in NAT_KINDS:
        raise ValueError(f"NAT kind {kind!r}: expected one of {', '.join(NAT_KINDS)}")
    how = "masquerade random" if kind == "random" else "masquerade"
    return f"""
table ip moshpit_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{WAN_IFACE}" {how}
    }}
}}
"""


def behind_router(host: Host, kind: str, switch: str, subnet: str) -> str:
    """Wire `host` behind its router (host.router, an empty namespace) on the switch at
    host.public_ip; returns the host's own (private) address."""
    router, i = host.router, host.index
    lan_net = f"192.168.{i}"
    run("ip", "link", "add", WAN_IFACE, "netns", router, "type", "veth",
        "peer", "name", host.port, "netns", switch)
    run("ip", "-n", switch, "link", "set", host.port, "master", "br0")
    run("ip", "-n", switch, "link", "set", host.port, "up")
    run("ip", "-n", router, "addr", "add", f"{host.public_ip}/24", "dev", WAN_IFACE)
    run("ip", "-n", router, "link", "set", WAN_IFACE, "up")
    run("ip", "link", "add", LAN_IFACE, "netns", router, "type", "veth",
        "peer", "name", HOST_IFACE, "netns", host.ns)
    run("ip", "-n", router, "addr", "add", f"{lan_net}.1/24", "dev", LAN_IFACE)
    run("ip", "-n", router, "link", "set", LAN_IFACE, "up")
    run("ip", "-n", host.ns, "addr", "add", f"{lan_net}.2/24", "dev", HOST_IFACE)
    run("ip", "-n", host.ns, "link", "set", HOST_IFACE, "up")
    run("ip", "-n", host.ns, "route", "add", "default", "via", f"{lan_net}.1")
    run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=nat_rules(kind))
    return f"{lan_net}.2"
