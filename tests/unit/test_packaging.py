"""What installing moshpit gives: console scripts that run, a daemon package free of torch, and a
Makefile whose TORCH_SPEC really chooses the torch in an existing venv."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # console scripts are installed next to the interpreter


def clean_env() -> dict[str, str]:
    """No MOSHPITD_* settings from whoever runs the tests, no outer make's flags."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MOSHPITD_") and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env=env or clean_env(), cwd=ROOT)


IMPORT_ALL = """
import importlib, json, pkgutil, sys
import moshpitd
names = sorted(m.name for m in pkgutil.walk_packages(moshpitd.__path__, "moshpitd.")
               if m.name.rpartition(".")[2] != "__main__")  # __main__ would run the daemon
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "torch": sorted(m for m in sys.modules
                                                     if m.split(".")[0] == "torch")}))
"""


def test_moshpitd_never_imports_torch() -> None:
    out = run(sys.executable, "-c", IMPORT_ALL)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    # the walk reached every layer, so "no torch" is about the whole daemon
    for name in ("moshpitd.cli", "moshpitd.service", "moshpitd.node", "moshpitd.launcher",
                 "moshpitd.sim", "moshpitd.dht.network", "moshpitd.ipc.server",
                 "moshpitd.matchmaking.matchmaker", "moshpitd.allreduce.butterfly",
                 "moshpitd.transport.dataplane"):
        assert name in found["imported"], found["imported"]
    assert found["torch"] == []
    # and torch is importable here: its absence above is the daemon's doing
    assert run(sys.executable, "-c", "import torch").returncode == 0


def test_moshpitd_console_script() -> None:
    daemon = str(BIN / "moshpitd")
    helped = run(daemon, "--help")
    assert helped.returncode == 0, helped.stderr
    for flag in ("--dht-listen", "--grpc-listen", "--bootstrap", "--ipc-socket",
                 "--metrics-listen", "--ready-file", "--log-level", "--check-config"):
        assert flag in helped.stdout
    checked = run(daemon, "--check-config", "--part-size", "8192",
                  env={**clean_env(), "MOSHPITD_LOG_LEVEL": "DEBUG"})
    assert checked.returncode == 0, checked.stderr
    settings = json.loads(checked.stdout)
    assert settings["part_size"] == {"value": 8192, "source": "flag --part-size"}
    assert settings["log_level"]["value"] == "DEBUG"
    assert "MOSHPITD_LOG_LEVEL" in settings["log_level"]["source"]
    assert "configuration is valid" in checked.stderr
    bad = run(daemon, "--check-config", "--part-size", "3")
    assert bad.returncode == 2 and "part_size" in bad.stderr, bad
    version = run(daemon, "--version")
    assert version.returncode == 0 and version.stdout.startswith("moshpitd ")


def test_moshpit_console_script(tmp_path: Path) -> None:
    client = str(BIN / "moshpit")
    helped = run(client, "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("status", "peers", "rounds"):
        assert command in helped.stdout
    missing = run(client, "status", "--socket", str(tmp_path / "none.sock"))
    assert missing.returncode == 1 and "cannot connect" in missing.stderr, missing


# --- Makefile: the torch spec an existing venv was installed with -------------------------
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "{log}"
"""


def make_venv(venv: Path, *assignments: str) -> list[str]:
    """`make venv` against a venv whose python only logs its arguments; returns the new calls."""
    log = venv.parent / "calls"
    before = log.read_text().splitlines() if log.exists() else []
    done = run("make", "-C", str(ROOT), "--no-print-directory", "venv", f"VENV={venv}",
               *assignments)
    assert done.returncode == 0, done.stdout + done.stderr
    # as if installed a while ago: a stamp written next has a later time on any filesystem
    past = os.stat(venv / ".installed").st_mtime - 10
    for stamp in (".installed", ".torch-spec"):
        os.utime(venv / stamp, (past, past))
    return log.read_text().splitlines()[len(before):]


def torch_installs(calls: list[str]) -> list[str]:
    return [c.split()[-1] for c in calls if re.fullmatch(r"-m pip install --quiet \S+", c)
            and c.split()[-1].startswith("torch")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_reinstalls_torch_when_torch_spec_changes(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(log=tmp_path / "calls"))
    python.chmod(0o755)
    default = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert default is not None

    first = make_venv(venv, "TORCH_SPEC=torch==1.0")
    assert torch_installs(first) == ["torch==1.0"], first
    assert any("install --quiet -e .[client,demo,dev]" in c for c in first), first
    assert make_venv(venv, "TORCH_SPEC=torch==1.0") == []  # nothing changed: nothing runs
    assert torch_installs(make_venv(venv, "TORCH_SPEC=torch==2.0")) == ["torch==2.0"]
    assert make_venv(venv, "TORCH_SPEC=torch==2.0") == []
    assert torch_installs(make_venv(venv)) == [default.group(1)]  # back to the default
    assert make_venv(venv) == []
    assert (venv / ".torch-spec").read_text().strip() == default.group(1)
