"""One host's link: its rate (tbf on both ends of its veth), the delay added to what it receives
(the delayer, see netlab/delayer.py) and the share of received packets it loses (nftables)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

HOST_IFACE = "eth0"
LOSS_SCALE = 10_000  # loss is drawn per packet as `numgen random mod 10000 < N`: 0.01 % steps


class NetnsError(RuntimeError):
    """A command building or changing the topology failed (the message says which and why)."""


def run(*args: str, check: bool = True, stdin: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30, input=stdin)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def parse_rate(rate: str | float) -> float:
    """Mbit/s from a number (already Mbit/s) or a tc-style string: '100mbit', '1gbit', '500kbit'."""
    if isinstance(rate, int | float):
        value = float(rate)
    else:
        text = rate.strip().lower().removesuffix("/s").removesuffix("ps")
        scale = {"gbit": 1000.0, "mbit": 1.0, "kbit": 1e-3, "bit": 1e-6}
        for unit, factor in scale.items():
            if text.endswith(unit):
                value = float(text[: -len(unit)]) * factor
                break
        else:
            raise ValueError(f"rate {rate!r}: expected Mbit/s or a number with gbit/mbit/kbit")
    if not value > 0:
        raise ValueError(f"rate must be positive, not {rate!r}")
    return value


@dataclass(frozen=True)
class LinkSpec:
    rate_mbit: float = 100.0
    delay_s: float = 0.0  # added to every packet this host receives: RTT(a, b) += d_a + d_b
    loss_pct: float = 0.0  # of the packets this host receives

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, not {self.rate_mbit}")
        if not 0 <= self.delay_s <= 10:
            raise ValueError(f"delay_s must be within [0, 10] seconds, not {self.delay_s}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"loss_pct must be within [0, 100), not {self.loss_pct}")

    @property
    def loss_threshold(self) -> int:
        return round(self.loss_pct / 100 * LOSS_SCALE)


def tbf_args(rate_mbit: float) -> list[str]:
    """A tbf qdisc at `rate_mbit`: the bucket holds at least one 64 KiB GSO packet and 2 ms at
    the rate (so fast links are not capped by timer granularity); ~20 ms of queue."""
    kbit = max(8, round(rate_mbit * 1000))
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))
    return ["tbf", "rate", f"{kbit}kbit", "burst", str(burst), "latency", "20ms"]


def shape(ns: str, dev: str, rate_mbit: float) -> None:
    run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_mbit))


def nft_rules(spec: LinkSpec, proxy_port: int) -> str:
    """Loss on input from the link; with a delay, tproxy hands all TCP and UDP to the delayer."""
    prerouting = ""
    if spec.delay_s > 0:
        prerouting = f"""
    chain prerouting {{
        type filter hook prerouting priority mangle; policy accept;
        iifname "{HOST_IFACE}" meta l4proto {{ tcp, udp }} tproxy to :{proxy_port}
    }}"""
    return f"""
table ip moshpit_netem {{{prerouting}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{HOST_IFACE}" numgen random mod {LOSS_SCALE} < {spec.loss_threshold} counter drop
    }}
}}
"""
