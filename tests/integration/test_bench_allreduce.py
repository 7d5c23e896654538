"""bench.allreduce on loopback, in small: the encrypted run beside the plain one, the cipher's
cost measured in the same invocation, and checked reductions against the encrypted run
(the long runs are in docs/wire.md and docs/security-identity.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

ELEMS = 256 * 1024


def test_encrypted_and_checked_beside_plain_with_their_costs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.allreduce", "--peers", "2", "--elems", str(ELEMS),
         "--repeat", "2", "--checked", "--skip-gloo", "--json"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"moshpit", "moshpit-encrypted", "moshpit-checked"}
    for r in rows.values():
        assert r["max_error"] < 1e-5 and r["partial_rounds"] == 0, r
    cost = report["encryption"]
    # each peer sends its half of the vector and gets the other's back: every byte it sends
    # is sealed by it and opened by the other
    assert cost["sealed_and_opened_bytes"] >= 2 * 2 * 4 * ELEMS, cost
    assert cost["aes_gcm_bytes_per_s"] > 1e8, cost
    assert math.isclose(cost["cipher_cpu_s"],
                        cost["sealed_and_opened_bytes"] / cost["aes_gcm_bytes_per_s"])
    assert math.isfinite(cost["extra_over_cipher"])
    checks = report["checks"]  # the checked run against the encrypted one: a few more bytes
    assert 1.0 < checks["wire_bytes_ratio"] < 1.1, checks
    assert math.isfinite(checks["daemon_cpu_ratio"]) and checks["wall_ratio"] > 0, checks
