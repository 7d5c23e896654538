"""The package as a user installs it: a wheel built from the tree, installed apart from it,
its entry point starting two daemons and its client averaging through them.

The editable install the suite runs in would hide a module left out of the wheel, so the
daemons and the trainer run with `python -S` (no site-packages, hence no editable finder) and
PYTHONPATH = the install folder, then the venv's site-packages for the dependencies.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from moshpitd.launcher import start_daemon

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "moshpitd", "client")

TRAINER = textwrap.dedent("""
    import sys, threading
    import moshpit, moshpitd, torch
    for module in (moshpit, moshpitd):  # from the install folder, never the tree
        assert module.__file__.startswith(sys.argv[1]), module.__file__
    clients = [moshpit.Client(path) for path in sys.argv[2:4]]
    values = [torch.full((1000,), 1.0), torch.full((1000,), 5.0)]
    out = [None, None]
    def call(i):
        out[i] = clients[i].average([values[i]], key="wheel", timeout=30, group_size=2)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i in range(2):
        assert out[i] is not None and torch.allclose(out[i][0], torch.full((1000,), 3.0)), out
        assert clients[i].last_round.group_size == 2, clients[i].last_round
    print("averaged", float(out[0][0][0]))
""")


def build_wheel(tmp: Path) -> Path:
    """From a copy of the sources, so no build/ or egg-info of the tree is reused or left."""
    src = tmp / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("moshpit-*.whl")
    return wheel


def test_wheel_installs_and_averages(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    # every package of the tree ships, and nothing of the tree's other folders
    expected = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "moshpitd").rglob("__init__.py")}
    assert expected <= packages, sorted(expected - packages)
    assert "moshpit" in packages and "moshpitd/local" in packages
    assert not {p for p in packages if p.split("/")[0] in ("bench", "demo", "netlab", "tests",
                                                           "client")}, packages

    target = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=240)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    entry = target / "bin" / "moshpitd"
    assert entry.exists(), sorted(p.name for p in (target / "bin").iterdir())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}
    env.pop("PYTHONHOME", None)
    command = [sys.executable, "-S", str(entry)]
    work = tmp_path / "run"
    daemons = [start_daemon("w0", work, command=command, env=env)]
    try:
        daemons.append(start_daemon("w1", work, bootstrap=[daemons[0].dht], command=command,
                                    env=env))
        trained = subprocess.run(
            [sys.executable, "-S", "-c", TRAINER, str(target),
             *(d.socket for d in daemons)], capture_output=True, text=True, timeout=90,
            env=env, cwd=tmp_path)
        assert trained.returncode == 0, (trained.stdout + trained.stderr + "\n"
                                         + "\n".join(d.log_tail() for d in daemons))
        assert "averaged 3.0" in trained.stdout
    finally:
        for d in daemons:
            d.stop()
    for d in daemons:  # they ran the installed code: a missing module would have killed them
        assert str(target) in " ".join(d.proc.args), d.proc.args  # type: ignore[arg-type]
        if "Traceback" in d.log_path.read_text():
            pytest.fail(d.log_tail())
