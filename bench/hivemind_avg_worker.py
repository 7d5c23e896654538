"""One host's hivemind 1.1.12 DecentralizedAverager for `bench.allreduce --netns`.

Runs in .venv-peers (`make peers`) inside a host's namespace and imports nothing from moshpit.
It speaks bench.worker's protocol: `go KEY` runs one `averager.step()` and answers one JSON line
with its time; `check` answers how far the averaged tensor is from the exact mean. The
averager keeps hivemind's defaults (min_matchmaking_time 5 s, request_timeout 3 s, 512 KiB parts,
no bandwidth declared) except target_group_size = min_group_size = peers: a full group starts
its round at once, as moshpit's and gloo's do. A round is bounded as hivemind.Optimizer bounds
one: "allreduce_timeout: timeout for a single attempt to run all-reduce, default: equal to
averaging_timeout" and "if an averaging step hangs for this long, it will be cancelled
automatically" (hivemind/optim/optimizer.py); without that an all-reduce whose partner went
quiet waits for ever, and the bench could not tell a failed round from a slow one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

multiprocessing.set_start_method("fork", force=True)  # hivemind forks its DHT and averager

import hivemind  # noqa: E402  (after the start method is set)
import torch  # noqa: E402


def emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ip", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--initial-peers", default="[]", help="JSON list of multiaddrs")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--elems", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.ip}/tcp/{args.port}"],
                       initial_peers=json.loads(args.initial_peers), start=True)
    tensor = torch.full((args.elems,), float(args.rank), dtype=torch.float32)
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor], dht, prefix="bench_allreduce", target_group_size=args.peers,
        min_group_size=args.peers, allreduce_timeout=args.timeout, start=True)
    expected = (args.peers - 1) / 2
    emit({"ready": True, "maddrs": [str(a) for a in dht.get_visible_maddrs()]})
    try:
        for line in sys.stdin:
            cmd, _, key = line.strip().partition(" ")
            if cmd == "quit":
                break
            if cmd == "check":
                with averager.get_tensors() as (out,):
                    lo, hi = torch.aminmax(out)
                emit({"max_error": max(abs(float(lo) - expected), abs(float(hi) - expected))})
                continue
            if cmd != "go":
                emit({"error": f"bad command {line.strip()!r}"})
                continue
            start = time.perf_counter()
            control = averager.step(weight=1.0, timeout=args.timeout, wait=False)
            try:
                gathered = control.result(args.timeout)
            except Exception as exc:  # a failed round is a row's failure, not the bench's
                control.cancel()
                emit({"failed": f"step failed: {exc!r}"[:300]})
                continue
            if gathered is None:  # hivemind's own word for a round that found no group
                emit({"failed": "step returned no group"})
                continue
            seconds = time.perf_counter() - start
            emit({"key": key, "seconds": seconds,
                  "group_size": len(gathered) if gathered else 0})
    finally:
        averager.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
