"""`python -m bench.allreduce`: moshpit averaging vs torch.distributed gloo all_reduce.

Both systems average one float32 tensor over P local processes; the moshpit time is what a
trainer waits for in `Client.average`, so it includes the IPC hand-off through the daemon.
With --passes K the two systems take turns K times and the ratio is the median of the passes'
ratios: on a shared machine the background load drifts, and one system measured a minute after
the other sees a different machine.

With --encrypted, moshpit also runs under a swarm key (every data-plane frame sealed with
AES-256-GCM), and the table says what encryption cost the daemons: their CPU beyond the plain
run's, against the cipher's own cost (the bytes they sealed and opened over the speed of
AES-256-GCM on one core of this machine, measured in the same invocation). That run does not
check results (`check_results = off`), so it measures encryption alone.

With --checked, moshpit also runs under the swarm key with checked reductions (the key's
default, docs/security-identity.md), beside the same without them, and the table says what the
checks cost: wall time, daemon CPU and bytes on the wire, checked over unchecked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any

from bench import allreduce_netns
from bench.allreduce_netns import HIVEMIND_PY
from bench.allreduce_netns import SYSTEMS as NETNS_SYSTEMS
from bench.cli import exit_on_sigterm, positive, print_columns
from bench.procs import BenchError
from bench.runners import Samples, merge, run_gloo, run_moshpit
from moshpitd.allreduce.codecs import CODECS as CODEC_TABLE
from moshpitd.ipc.schema import AGGREGATIONS

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
CODECS = tuple(CODEC_TABLE)


def parse_elems(text: str) -> int:
    """8M -> 8 * 1024 * 1024: binary suffixes, so sizes match power-of-two tensor shapes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text.upper())
    if m is None or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive count like 8M, got {text!r}")
    return int(m.group(1)) * SUFFIXES[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__)
    p.add_argument("--peers", type=positive, default=4, help="processes per system (default 4)")
    p.add_argument("--elems", type=parse_elems, default=8 << 20, metavar="E",
                   help="float32 elements; K/M/G suffixes are binary, M = 1024*1024 "
                        "(default 8M = 8388608)")
    p.add_argument("--codec", default="none",
                   help="wire codec for moshpit: none, fp16, bf16, int8, int4 (default none)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default="mean",
                   help="how moshpit groups combine values (default mean; gloo always averages)")
    p.add_argument("--ipc", choices=["shared", "copy"], default="shared",
                   help="shared: tensors live in memory the daemon maps (no copies); copy: "
                        "plain tensors, copied into and out of the shared buffer per call")
    p.add_argument("--repeat", type=positive, default=5,
                   help="timed repeats after one warm-up (default 5)")
    p.add_argument("--passes", type=positive, default=1,
                   help="moshpit and gloo take turns this many times, each with a warm-up and "
                        "--repeat repeats; ratio = median of the passes' ratios (default 1)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="per-round timeout in seconds (default 120)")
    p.add_argument("--min-group-size", type=positive, metavar="N",
                   help="moshpit min_group_size (default: --peers, so every round averages all "
                        "peers like gloo does; 2, the client's default, lets rounds split)")
    p.add_argument("--encrypted", action="store_true",
                   help="also run moshpit under a swarm key (every frame sealed), and report "
                        "the daemons' extra CPU against the cipher's own cost")
    p.add_argument("--checked", action="store_true",
                   help="also run moshpit under a swarm key with checked reductions, and report "
                   "their cost against the same without them (implies --encrypted)")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.add_argument("--skip-gloo", action="store_true", help="run moshpit only")
    p.add_argument("--skip-moshpit", action="store_true", help="run gloo only")
    p.add_argument("--workdir", help="keep moshpit daemon logs and sockets here")
    net = p.add_argument_group("emulated links (bench/allreduce_netns.py; needs root)")
    net.add_argument("--netns", metavar="SPEC",
                     help="run every system on network namespaces with these links instead of "
                          "loopback: host rates in Mbit/s, then rtt=MS, loss=PCT and nat=N, "
                          "e.g. 200,200,20,20 or 4x100,rtt=50,loss=1 or 4x100,nat=2 (--peers "
                          "is the host count)")
    net.add_argument("--systems", default=",".join(s for s in NETNS_SYSTEMS
                                                   if s != "moshpit-relayed"),
                     help="with --netns: which systems, in this order (of "
                          f"{','.join(NETNS_SYSTEMS)}; default all but moshpit-relayed; "
                          "moshpit-unchecked is check_results = off, moshpit-plain also "
                          "data_encryption = off, moshpit-relayed direct_paths = off)")
    net.add_argument("--warmup", type=positive, default=2,
                     help="with --netns: untimed rounds first (default 2: moshpit's first "
                          "round measures the links, its second uses the rates)")
    net.add_argument("--hivemind-python", default=str(HIVEMIND_PY),
                     help="with --netns: the interpreter that has hivemind 1.1.12 (default: "
                          ".venv-peers, `make peers`)")
    p.add_argument("--daemon-log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="moshpitd --log-level")
    return p


def summarize(s: Samples, peers: int, elems: int) -> dict[str, Any]:
    """Median/min/max over repeats; moshpit also gets its daemon-side breakdown."""
    row: dict[str, Any] = {
        "system": s.system, "peers": peers, "elems": elems,
        "median_s": statistics.median(s.seconds), "min_s": min(s.seconds),
        "max_s": max(s.seconds), "samples_s": s.seconds, "max_error": s.max_error,
    }
    if s.daemon_seconds:
        row.update({
            "daemon_median_s": statistics.median(s.daemon_seconds),
            "matchmaking_median_s": statistics.median(s.matchmaking_seconds),
            "allreduce_median_s": statistics.median(s.reduce_seconds),
            "ipc_overhead_median_s": statistics.median(s.overhead_seconds),
            "daemon_cpu_median_s": statistics.median(s.daemon_cpu_seconds),
            "partial_rounds": s.partial_rounds,
        })
    return row


def aes_gcm_speed(total: int = 256 << 20, frame: int = 1 << 20) -> float:
    """Bytes/s that AES-256-GCM seals on one core here, in place, frame by frame through a
    buffer far larger than the caches, as the data plane seals parts of a trainer's tensors
    (best of three: the machine is shared)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    step = frame + 16
    buf = bytearray(os.urandom(1 << 20) * (total // (1 << 20))) + bytearray(16 * (total // frame))
    view = memoryview(buf)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(total // frame):
            at = i * step
            aead.encrypt_into(i.to_bytes(12, "little"), view[at:at + frame], b"h" * 24,
                              view[at:at + step])
        best = min(best, time.perf_counter() - start)
    return total / best


def cipher_cost(rows: list[dict[str, Any]], passes: list[dict[str, Samples]], speed: float
                ) -> dict[str, float] | None:
    """The encrypted row's daemon CPU beyond the plain row's, per round, and the cipher's own
    cost for the bytes those daemons sealed and opened."""
    enc = next((r for r in rows if r["system"] == "moshpit-encrypted"), None)
    plain = next((r for r in rows if r["system"] == "moshpit"), None)
    if enc is None or plain is None:
        return None
    wire = statistics.median(b for p in passes for b in p["moshpit-encrypted"].wire_bytes)
    extra = enc["daemon_cpu_median_s"] - plain["daemon_cpu_median_s"]
    cipher = wire / speed
    return {"aes_gcm_bytes_per_s": speed, "sealed_and_opened_bytes": wire,
            "cipher_cpu_s": cipher, "extra_cpu_s": extra, "extra_over_cipher": extra / cipher}


def check_cost(rows: list[dict[str, Any]], passes: list[dict[str, Samples]]
               ) -> dict[str, float] | None:
    """The checked row against the unchecked encrypted one, per round: wall time, daemons'
    CPU and wire bytes."""
    checked = next((r for r in rows if r["system"] == "moshpit-checked"), None)
    base = next((r for r in rows if r["system"] == "moshpit-encrypted"), None)
    if checked is None or base is None:
        return None

    def wire(system: str) -> float:
        return statistics.median(b for p in passes for b in p[system].wire_bytes)

    return {"wall_ratio": checked["median_s"] / base["median_s"],
            "daemon_cpu_ratio": checked["daemon_cpu_median_s"] / base["daemon_cpu_median_s"],
            "wire_bytes_ratio": wire("moshpit-checked") / wire("moshpit-encrypted"),
            "extra_cpu_s": checked["daemon_cpu_median_s"] - base["daemon_cpu_median_s"]}


def fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-" if value is None else str(value)


def print_table(rows: list[dict[str, Any]], ratio: float | None,
                ratios: list[float], cost: dict[str, float] | None = None,
                checks: dict[str, float] | None = None) -> None:
    cols = [("system", "system"), ("peers", "peers"), ("elems", "elems"),
            ("median_s", "median s"), ("min_s", "min s"), ("max_s", "max s"),
            ("daemon_median_s", "daemon s"), ("matchmaking_median_s", "match s"),
            ("allreduce_median_s", "reduce s"), ("ipc_overhead_median_s", "ipc s"),
            ("daemon_cpu_median_s", "cpu s"), ("partial_rounds", "split")]
    cells = [[title for _, title in cols]] + [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    print_columns(cells)
    if ratio is not None and len(ratios) > 1:
        print(f"\nratio moshpit median / gloo median: {ratio:.2f}x (median of {len(ratios)} "
              f"passes: {', '.join(f'{r:.2f}' for r in ratios)})")
    elif ratio is not None:
        print(f"\nratio moshpit median / gloo median: {ratio:.2f}x")
    if cost is not None:
        print(f"\nencryption: the daemons sealed and opened "
              f"{cost['sealed_and_opened_bytes'] / 1e9:.2f} GB per round; AES-256-GCM runs at "
              f"{cost['aes_gcm_bytes_per_s'] / 1e9:.2f} GB/s on one core here, so the cipher "
              f"itself costs {cost['cipher_cpu_s']:.3f} CPU s; the daemons used "
              f"{cost['extra_cpu_s']:.3f} CPU s more than without encryption "
              f"({cost['extra_over_cipher']:.2f}x the cipher's cost)")
    if checks is not None:
        print(f"\nchecked reductions, against the same encrypted run without them: wall "
              f"{checks['wall_ratio']:.3f}x, daemon CPU {checks['daemon_cpu_ratio']:.3f}x "
              f"({checks['extra_cpu_s']:+.3f} CPU s), wire bytes "
              f"{checks['wire_bytes_ratio']:.4f}x")
    for r in rows:
        if r.get("partial_rounds"):
            print(f"WARNING: in {r['partial_rounds']} of {len(r['samples_s'])} {r['system']} "
                  "repeats the peers split into smaller groups (not one average of all peers)")
    print("\nTimes are medians over repeats of the slowest peer per repeat. daemon = the "
          "daemon's own\ntime (match = matchmaking, reduce = daemon - match); ipc = call - "
          "daemon time (median\nover peers and repeats); cpu = CPU seconds all daemons used "
          "in one call; split = repeats\nwhose peers did not all form one group.")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.netns:
        exit_on_sigterm()
        try:
            return allreduce_netns.main(args)
        except KeyboardInterrupt:
            print("bench.allreduce: interrupted; children stopped", file=sys.stderr)
            return 130
    if args.codec not in CODECS:
        parser.error(f"--codec {args.codec!r} is not supported; supported: "
                     f"{', '.join(CODECS)}")
    if args.skip_gloo and args.skip_moshpit:
        parser.error("--skip-gloo and --skip-moshpit together leave nothing to run")
    if args.peers < 2:
        parser.error("--peers must be at least 2 (moshpit needs a group of two)")
    if args.min_group_size is None:
        args.min_group_size = args.peers
    if args.min_group_size > args.peers:
        parser.error("--min-group-size cannot exceed --peers")
    exit_on_sigterm()
    passes: list[dict[str, Samples]] = []
    try:
        for _ in range(args.passes):
            done: dict[str, Samples] = {}
            variants = [(False, False)]
            if args.encrypted or args.checked:
                variants.append((True, False))
            if args.checked:
                variants.append((True, True))
            for encrypted, checked in variants:
                if args.skip_moshpit:
                    break
                run = run_moshpit(args.peers, args.elems, args.repeat, args.timeout,
                                  args.workdir, args.daemon_log_level, args.min_group_size,
                                  args.codec, args.ipc, args.aggregation, encrypted, checked)
                done[run.system] = run
            if not args.skip_gloo:
                done["gloo"] = run_gloo(args.peers, args.elems, args.repeat, args.timeout)
            passes.append(done)
    except BenchError as exc:
        print(f"bench.allreduce: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.allreduce: interrupted; children stopped", file=sys.stderr)
        return 130
    rows = [summarize(merge([p[system] for p in passes]), args.peers, args.elems)
            for system in passes[0]]
    ratios = [statistics.median(p["moshpit"].seconds) / statistics.median(p["gloo"].seconds)
              for p in passes if {"moshpit", "gloo"} <= p.keys()]
    ratio = statistics.median(ratios) if ratios else None
    cost = cipher_cost(rows, passes, aes_gcm_speed()) if args.encrypted or args.checked \
        else None
    checks = check_cost(rows, passes)
    if args.json:
        print(json.dumps({"peers": args.peers, "elems": args.elems, "codec": args.codec,
                          "aggregation": args.aggregation,
                          "ipc": args.ipc, "min_group_size": args.min_group_size,
                          "repeat": args.repeat, "passes": args.passes, "rows": rows,
                          "ratio": ratio, "pass_ratios": ratios, "encryption": cost,
                          "checks": checks}, indent=2))
    else:
        print_table(rows, ratio, ratios, cost, checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
