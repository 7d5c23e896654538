"""One rank of the torch.distributed gloo baseline: all_reduce(SUM) then divide, an average.

It runs the warm-up and every repeat by itself (a barrier before each one lines the ranks up)
and prints one JSON line with its per-repeat times at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--addr", default="127.0.0.1", help="rank 0's address (its TCP store)")
    p.add_argument("--elems", type=int, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1, help="untimed all_reduces first")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}",
                            rank=args.rank, world_size=args.peers,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        tensor = torch.full((args.elems,), float(args.rank), dtype=torch.float32)
        times = []
        for _ in range(args.warmup + args.repeat):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(args.peers)
            times.append(time.perf_counter() - start)
        error = float((tensor - (args.peers - 1) / 2).abs().max())
        print(json.dumps({"times": times[args.warmup:], "warmup": times[:args.warmup],
                          "max_error": error}),
              flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
