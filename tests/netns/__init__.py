"""A small emulated network for integration tests: hosts in Linux network namespaces on one
bridge, each link capped with `tc tbf`, losing packets at random with nftables, and delayed by
a transparent userspace proxy (this kernel has no `netem`).

Layout (names carry a random tag, so runs never collide and nothing is created in the root
namespace):

    <tag>-sw    the "switch": a bridge `br0` with ports p1..pN
    <tag>-h1..  one namespace per host: `eth0` (10.A.B.i/24), the other end of veth pI

Per host:
  * bandwidth: `tbf` at `rate` on both ends of its veth (host upload and download);
  * loss: an nftables rule on input from `eth0`, `numgen random mod 100 < loss_pct drop`;
  * latency: an nftables `tproxy` rule hands every TCP connection and UDP datagram arriving on
    `eth0` to a delayer process running in the namespace (tests/netns/delayer.py, run as
    `python tests/netns/delayer.py delay ...`; tests/netns/topology.py builds the rest).
    TCP: the delayer accepts the connection in place of its real destination, connects to the
    original address over loopback, and forwards each direction's bytes `delay` seconds after
    reading them (so request/response round trips get 2 x delay). UDP: it re-sends each
    datagram `delay` seconds later from a transparent socket bound to the original source
    address, so the receiver still sees the sender's real address (Kademlia uses it as the
    contact's address); a reply is delayed the same way on the other host. Every host-to-host
    round trip, TCP or UDP, is therefore about 2 x delay longer.

Daemons bind their host's address directly (no port games): the interception is invisible to
them. Run as `python tests/netns/delayer.py delay|ping ...` inside a namespace for the helper
processes.
"""

from tests.netns.topology import Host, NetnsError, Topology, missing_prerequisites, run

__all__ = ["Host", "NetnsError", "Topology", "missing_prerequisites", "run"]
