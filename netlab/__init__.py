"""An emulated network for tests and benchmarks: hosts in Linux network namespaces on one
bridge, each link capped with `tc tbf`, losing packets at random with nftables, delayed by a
transparent userspace proxy (this kernel has no `netem`), and each host's processes held to an
equal CPU quota by a cgroup.

Layout (names carry a random tag, so runs never collide and nothing is created in the root
namespace):

    <tag>-sw    the "switch": a bridge `br0` with ports p1..pN
    <tag>-h1..  one namespace per host: `eth0` (10.A.B.i/24), the other end of veth pI

Per host (netlab.links.LinkSpec; `Topology(links=[...])` gives each host its own):
  * rate: `tbf` on both ends of its veth (host upload and download); `set_rate` changes it
    while traffic flows (a slow-link event);
  * loss: an nftables rule on input from `eth0`, `numgen random mod 10000 < N drop`;
  * delay: with delay_s > 0, an nftables `tproxy` rule hands every TCP connection and UDP
    datagram arriving on `eth0` to a delayer process in the namespace (netlab/delayer.py, run
    as `python netlab/delayer.py delay ...`). TCP: the delayer accepts the connection in place
    of its real destination, connects to the original address over loopback, and forwards
    each direction's bytes `delay` seconds after reading them. UDP: it re-sends each datagram
    `delay` seconds later from a transparent socket bound to the original source address, so
    the receiver still sees the sender's real address (Kademlia uses it as the contact's
    address). So a TCP connection to host b carries d_b in each direction (its round trip
    takes 2 d_b more, whoever sends), and a UDP request from a to b with its reply takes
    d_a + d_b more; with equal delays d, every round trip takes 2 d more. Replies on a
    connection a host opened itself reach their socket directly (tproxy finds the established
    socket first). A host with no delay gets no delayer and no tproxy rule;
  * CPU (netlab.cgroup.CpuGroup, with `cpu_cores`): every process started with `spawn` or
    `start_daemon` joins the host's cgroup before it execs, so its children do too;
    `kill_host` SIGKILLs them all (a preemption). The delayer stays outside: its CPU is the
    emulation's, reported by `delayer_cpu_seconds`;
  * counters: `counters(host)` reads eth0's tx/rx bytes (every byte the host sent or
    received, whatever process sent it) from /proc without starting a process.

Daemons bind their host's address directly (no port games): the interception is invisible to
them. Needs root, `ip`, `tc`, `nft` and (for CPU quotas) a writable cgroup v1 `cpu` or v2
hierarchy; `missing_prerequisites()` says what is missing.
"""

from netlab.cgroup import CgroupError, CpuGroup, cgroup_problem
from netlab.links import LinkSpec, NetnsError, parse_rate, run
from netlab.topology import (
    DATA_PORT,
    DHT_PORT,
    GRPC_PORT,
    Host,
    Topology,
    missing_prerequisites,
)

__all__ = ["DATA_PORT", "DHT_PORT", "GRPC_PORT", "CgroupError", "CpuGroup", "Host", "LinkSpec",
           "NetnsError", "Topology", "cgroup_problem", "missing_prerequisites", "parse_rate",
           "run"]
