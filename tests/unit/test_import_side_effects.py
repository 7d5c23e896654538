"""Importing moshpitd (or the client) changes nothing in the importing process: the daemon's
process settings (single-threaded BLAS) are made by its entry point, before numpy loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import moshpitd.service
from moshpitd import cli


def test_importing_sets_no_environment() -> None:
    code = ("import os, moshpitd, moshpitd.allreduce.layout, moshpitd.ipc.session, moshpit; "
            "print(os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_the_daemon_entry_point_sets_single_threaded_blas(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    seen: list[str | None] = []

    async def fake_serve(*args: object, **kwargs: object) -> int:
        seen.append(os.environ.get("OPENBLAS_NUM_THREADS"))
        return 0

    monkeypatch.setattr(moshpitd.service, "serve", fake_serve)
    assert cli.main(["--ipc-socket", "/tmp/moshpitd-side-effects.sock",
                     "--peer-key-file", str(tmp_path / "peer.key")]) == 0
    assert seen == ["1"]
