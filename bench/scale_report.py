"""Printing bench.scale's report: kept apart so the measuring code reads on its own."""

from __future__ import annotations

import os
from typing import Any

GOAL_MB = 100.0  # the goal: RSS of one idle daemon


def fmt(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else "-" if value is None \
        else str(value)


def print_report(r: dict[str, Any]) -> None:
    n, idle = r["daemons"], r["idle"]
    print(f"swarm: {n} daemons on {os.cpu_count()} cores, started in {r['start_s']:.1f} s "
          f"(all ready files written)")
    print(f"\nidle daemon memory after {r['idle_seconds']:.0f} s idle (MB):")
    table = [("", "min", "median", "max", "total"),
             ("RSS", *(fmt(idle[k]) for k in ("rss_min_mb", "rss_median_mb", "rss_max_mb",
                                              "rss_total_mb"))),
             ("PSS", "", fmt(idle["pss_median_mb"]), "", fmt(idle["pss_total_mb"]))]
    for label, mem in (("after rounds", r.get("after_rounds")),):
        if mem:
            table.append((f"RSS {label}", *(fmt(mem[k]) for k in (
                "rss_min_mb", "rss_median_mb", "rss_max_mb", "rss_total_mb"))))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        print("  " + "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths, strict=True))))
    print(f"  goal <= {GOAL_MB:.0f} MB RSS each: "
          f"{'met' if idle['over_goal'] == 0 else 'MISSED'} ({idle['over_goal']} over); "
          f"MemAvailable {r['mem_available_before_mb']:.0f} -> "
          f"{idle['mem_available_mb']:.0f} MB")
    print(f"  idle swarm CPU: {r['idle_usage']['daemon_cores']:.2f} cores, "
          f"{r['idle_usage']['dht_datagrams'] / r['idle_usage']['wall_s']:.0f} DHT datagrams/s")
    if r.get("client_process"):
        c = r["client_process"]
        print(f"\none trainer-like client process (python+torch+moshpit): RSS "
              f"{c['rss_mb']:.0f} MB, PSS {c['pss_mb']:.0f} MB -> {n} of them ~"
              f"{n * c['pss_mb'] / 1024:.1f} GB PSS; used {n} threads in one process instead")
    g = r.get("full_grid")
    if g:
        print(f"\nfull grid {r['grid']} with initial_coords, rounds={g['rounds']} in one call, "
              f"{g['elems']} floats each:")
        print(f"  wall {g['wall_s']:.2f} s (slowest peer {g['call_max_s']:.2f} s, median "
              f"{g['call_median_s']:.2f} s); per-round matchmaking median "
              f"{fmt(g['round_mm_median_s'], 3)} s, max {fmt(g['round_mm_max_s'], 3)} s")
        print(f"  daemons busy {g['daemon_cores']:.2f} cores (machine {g['machine_cores']:.2f}),"
              f" {g['dht_datagrams_per_daemon_round']:.0f} DHT datagrams per daemon per round")
        print(f"  peers with full groups in all rounds: {g['peers_all_rounds_full']}/{n}; "
              f"daemon round results {g['results']}; last round per peer {g['last_rounds']}")
        print(f"  max |peer - global mean| = {fmt(g['max_abs_error'], 9)} -> "
              f"{'EXACT (< 1e-5)' if g['exact'] else 'NOT EXACT'}"
              + (f"; {len(g['errors'])} peer errors" if g["errors"] else ""))
    rc = r.get("random_cells")
    if rc:
        print(f"\nwithout initial_coords (emptiest cells): {rc['cells_occupied']} of "
              f"{rc['cells']} cells taken (at most {rc['max_per_cell']} per cell), one round "
              "per call:")
        head = ("call", "MSE/initial", "wall s", "round mm med/max s", "cores", "dht dgrams",
                "rounds", "group sizes", "daemon results", "errors")
        rows = [head] + [(
            str(c["call"]), f"{c['mse_ratio']:.3g}", f"{c['wall_s']:.2f}",
            f"{fmt(c['round_mm_median_s'], 2)}/{fmt(c['round_mm_max_s'], 2)}",
            f"{c['daemon_cores']:.2f}", f"{c['dht_datagrams_per_daemon_round']:.0f}",
            ",".join(map(str, c["rounds"])),
            " ".join(f"{k}:{v}" for k, v in c["group_sizes"].items()),
            " ".join(f"{k}:{v}" for k, v in c["results"].items()), str(len(c["errors"])))
            for c in rc["calls"]]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        for row in rows:
            print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        print(f"  drift of the global mean: {rc['mean_drift']:.2e} (group sizes: size:peers; "
              "cores: daemon CPU over the call; dht dgrams: DHT datagrams each daemon sent per "
              "round)")
    if r.get("stop"):
        s = r["stop"]
        print(f"\nstopped in {s['seconds']:.1f} s; exit codes {s['codes']}")
    c = r["code"]
    print(f"code: commit {c['commit']}, {c['dirty_files']} changed file(s) under moshpitd/ and "
          "client/")


# --- main ---------------------------------------------------------------------------------------
