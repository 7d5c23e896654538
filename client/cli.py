"""`moshpit`: inspect a running daemon through its IPC socket."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from moshpit.client import Client
from moshpit.errors import MoshpitError

DEFAULT_SOCKET = os.environ.get("MOSHPIT_SOCKET", "/run/moshpitd/moshpitd.sock")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moshpit", description="Inspect a running moshpitd")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("status", "peer id, endpoints, DHT peers, rounds done"),
                       ("rounds", "the last rounds: key, group size, bytes, seconds, result")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--socket", default=DEFAULT_SOCKET, help="daemon IPC socket")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    try:
        with Client(args.socket) as client:
            if args.command == "status":
                reply = client.status()
                st = reply["status"]
                if args.json:
                    print(json.dumps({**st, "metrics": reply.get("metrics"),
                                      "ipc": reply.get("ipc")}))
                else:
                    print(f"peer id      {st['peer_id']}")
                    print(f"dht          {st['dht']}")
                    print(f"grpc         {st['grpc']}")
                    print(f"ipc          {reply.get('ipc')}")
                    print(f"metrics      {reply.get('metrics')}")
                    print(f"dht peers    {st['dht_peers']}")
                    print(f"rounds done  {st['rounds_done']} ({st['rounds_failed']} failed)")
            else:
                rounds = client.rounds()
                if args.json:
                    print(json.dumps(rounds))
                else:
                    print(f"{'key':<20} {'group':>5} {'sent':>12} {'received':>12} "
                          f"{'seconds':>8}  result")
                    for r in rounds:
                        print(f"{r['key'][:20]:<20} {r['group_size']:>5} {r['bytes_sent']:>12} "
                              f"{r['bytes_received']:>12} {r['seconds']:>8.3f}  {r['result']}")
    except MoshpitError as exc:
        print(f"moshpit: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
