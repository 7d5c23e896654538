"""`moshpit`: inspect a running daemon through its IPC socket."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from moshpit.control import DaemonControl
from moshpit.errors import MoshpitError

DEFAULT_SOCKET = os.environ.get("MOSHPIT_SOCKET", "/run/moshpitd/moshpitd.sock")
COMMANDS = (("status", "peer id, endpoints, DHT peers, rounds done"),
            ("peers", "DHT contacts and, per grid run, the peers' cells"),
            ("rounds", "the last rounds: key, group size, bytes, seconds, result"))


def show_status(reply: dict[str, Any]) -> None:
    st = reply["status"]
    print(f"peer id      {st['peer_id']}")
    print(f"dht          {st['dht']}")
    print(f"grpc         {st['grpc']}")
    print(f"ipc          {reply.get('ipc')}")
    print(f"metrics      {reply.get('metrics')}")
    print(f"dht peers    {st['dht_peers']}")
    reach = st.get("reachability")
    if isinstance(reach, dict):  # older daemons say nothing of it
        print(f"reachable    {reach['state']}: {reach['why']}")
        by = reach.get("relayed_by")
        if by:
            print(f"relayed by   {by['peer_id'][:16]} (gRPC {by['grpc']}, data {by['data']})")
        relaying = reach.get("relaying") or {}
        if relaying.get("reservations"):
            print(f"relaying for {relaying['reservations']} private peer(s)")
    print(f"rounds done  {st['rounds_done']} ({st['rounds_failed']} failed)")
    if st.get("draining"):
        print("state        draining (shutting down)")
    for key, g in sorted(st.get("local_groups", {}).items()):  # this host's trainers as one peer
        ranks = ", ".join(str(r) for r in g["ranks"])
        print(f"local group  {key}: {g['mode']}, ranks {ranks or '-'} of {g['local_world']}, "
              f"{g['state']}")


def show_peers(peers: dict[str, Any]) -> None:
    contacts = peers["contacts"]
    print(f"{len(contacts)} DHT contact(s)")
    for c in contacts:
        print(f"  {c['peer_id'][:16]}  {c['dht']}")
    for run, entries in sorted(peers["runs"].items()):
        print(f"run {run}: {len(entries)} peer(s)")
        for e in entries:
            coords = ",".join(str(c) for c in e["coords"])
            print(f"  {e['peer_id'][:16]}  cell ({coords})  round {e['round']}  {e['grpc']}")


def show_rounds(rounds: list[dict[str, Any]]) -> None:
    print(f"{'key':<20} {'group':>5} {'sent':>12} {'received':>12} {'seconds':>8}  result")
    for r in rounds:
        print(f"{r['key'][:20]:<20} {r['group_size']:>5} {r['bytes_sent']:>12} "
              f"{r['bytes_received']:>12} {r['seconds']:>8.3f}  {r['result']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moshpit", description="Inspect a running moshpitd")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS:
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--socket", default=DEFAULT_SOCKET,
                        help="daemon IPC socket (default $MOSHPIT_SOCKET or "
                        "/run/moshpitd/moshpitd.sock)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    try:
        with DaemonControl(args.socket) as client:
            if args.command == "status":
                reply = client.status()
                data: Any = {**reply["status"], "metrics": reply.get("metrics"),
                             "ipc": reply.get("ipc")}
                show = lambda: show_status(reply)  # noqa: E731
            elif args.command == "peers":
                data = client.peers()
                show = lambda: show_peers(data)  # noqa: E731
            else:
                data = client.rounds()
                show = lambda: show_rounds(data)  # noqa: E731
    except MoshpitError as exc:
        print(f"moshpit: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data))
    else:
        show()
    return 0


if __name__ == "__main__":
    sys.exit(main())
