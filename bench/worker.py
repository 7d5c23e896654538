"""A trainer-like moshpit peer, driven by the orchestrator over stdin.

It reads `go KEY` lines and answers each with one JSON line of timings, so all peers of a
repeat start together and only the `average` call itself is timed. The result is checked only
on a later `check` line, once every peer has answered: checking 128 MiB while other peers'
rounds still run would steal their CPU and show up in their times (gloo's ranks check once,
after all repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import moshpit


def emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--socket", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--elems", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--min-group-size", type=int, default=2)
    p.add_argument("--ipc", choices=["shared", "copy"], default="shared")
    p.add_argument("--codec", default="none")
    p.add_argument("--aggregation", default="mean")
    args = p.parse_args()
    torch.set_num_threads(1)
    # Rank r contributes r everywhere, so every element of the average is (P - 1) / 2 (also
    # for the robust aggregations: the values are symmetric about it and nobody is clipped).
    tensor = torch.full((args.elems,), float(args.rank), dtype=torch.float32)
    expected = (args.peers - 1) / 2
    checkable: torch.Tensor | None = None
    with moshpit.Client(args.socket) as client:
        if args.ipc == "shared":  # the tensor lives in memory the daemon maps: no copies
            (tensor,) = client.share([tensor])
        emit({"ready": True, "peer_id": client.peer_id})
        for line in sys.stdin:
            cmd, _, key = line.strip().partition(" ")
            if cmd == "quit":
                break
            if cmd == "check":
                error = None  # only a full group's average is known in advance
                if checkable is not None:
                    lo, hi = torch.aminmax(checkable)  # one pass, no tensor-sized temporaries
                    error = max(abs(float(lo) - expected), abs(float(hi) - expected))
                emit({"max_error": error})
                continue
            if cmd != "go" or not key:
                emit({"error": f"bad command {line.strip()!r}"})
                continue
            checkable = None
            try:
                start = time.perf_counter()
                (out,) = client.average([tensor], key=key, weight=1.0, timeout=args.timeout,
                                        group_size=args.peers,
                                        min_group_size=args.min_group_size,
                                        codec=args.codec, aggregation=args.aggregation)
                seconds = time.perf_counter() - start
            except moshpit.MoshpitError as exc:
                emit({"error": str(exc)})  # the daemon's error name is already in it
                continue
            info = client.last_round
            assert info is not None
            emit({"key": key, "seconds": seconds, "daemon_seconds": info.seconds,
                  "matchmaking_seconds": info.matchmaking_seconds,
                  "group_size": info.group_size, "bytes_sent": info.bytes_sent,
                  "fully_averaged": info.fully_averaged})
            checkable = out if info.group_size == args.peers else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
