"""One rank of bench.training's baseline: torch DistributedDataParallel over gloo.

Gradients are all-reduced (averaged) in every backward pass, so all ranks hold one model; rank
0 evaluates it. Same protocol and loop as bench.training_worker. A collective that fails (a
peer died, or stayed silent past init_process_group's timeout) is reported as an "error"
event and the process exits at once: destroy_process_group could wait on the dead peer.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.training_worker import common_parser, emit, train, wait_for_go
from demo.model import load_shard, make_model


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCP store on 127.0.0.1")
    p.add_argument("--timeout", type=float, default=15.0,
                   help="collective timeout: how long a dead peer can go unnoticed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shard = load_shard(args.rank, args.peers, args.data)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.peers,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = make_model()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights (identical anyway)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    emit("ready", t=time.monotonic())
    wait_for_go()
    try:
        train(args, shard, ddp, model, opt, lambda n: opt.step(), evaluate=args.rank == 0)
    except Exception as exc:  # gloo raises DistBackendError (a RuntimeError) or a timeout
        emit("error", t=time.monotonic(), kind=type(exc).__name__,
             message=str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "")
        sys.stderr.flush()
        os._exit(1)  # no destroy_process_group: it may block on the dead peer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
