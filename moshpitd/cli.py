"""`moshpitd`: settings from flags, environment and file; then run the service."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from moshpitd import __version__
from moshpitd.config import ConfigError, Settings, add_flags, load
from moshpitd.identity import IdentityError, KeyFileLock, PeerKey, default_key_file
from moshpitd.logs import setup_logging
from moshpitd.transport.security import load_secrets

log = logging.getLogger("moshpitd")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moshpitd", description="Moshpit All-Reduce daemon. Every setting below is also a "
        "key of the --config file and a MOSHPITD_* environment variable; flags win over the "
        "environment, which wins over the file.")
    p.add_argument("--config", metavar="PATH",
                   help="TOML settings file (default /etc/moshpitd/moshpitd.toml if it exists; "
                   "env MOSHPITD_CONFIG)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the settings, print them with their sources as JSON, exit")
    add_flags(p)
    p.add_argument("--version", action="version", version=f"moshpitd {__version__}")
    return p


def settings_from_argv(argv: Sequence[str] | None = None) -> tuple[Settings, bool]:
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "check_config")}
    return load(flags, config_path=args.config), bool(args.check_config)


async def _on_logged_loop(coro_main: Coroutine[Any, Any, int], why: str) -> int:
    loop = asyncio.get_running_loop()
    log.info("event loop: %s.%s%s", type(loop).__module__, type(loop).__qualname__, why)
    return await coro_main


def run(coro_main: Coroutine[Any, Any, int]) -> int:
    """Runs the service on uvloop, or on asyncio's own loop if uvloop is missing (it is a
    dependency on Linux, so that means a broken install); the loop in use is logged at INFO."""
    try:
        import uvloop
    except ImportError as exc:  # pragma: no cover - uvloop is a dependency on Linux
        return int(asyncio.run(_on_logged_loop(coro_main, f" (uvloop unavailable: {exc})")))
    return int(uvloop.run(_on_logged_loop(coro_main, f" (uvloop {uvloop.__version__})")))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, check_only = settings_from_argv(argv)
        secrets = load_secrets(settings.swarm_key_file, settings.tls_cert, settings.tls_key,
                               settings.tls_ca, settings.tls_server_name)
    except (ConfigError, ValueError) as exc:
        print(f"moshpitd: configuration error: {exc}", file=sys.stderr)
        return 2
    key_file = settings.peer_key_file or default_key_file()
    lock: KeyFileLock | None = None
    try:  # checking never creates the key; starting does, on first start
        if not check_only:
            identity: PeerKey | None = PeerKey.load_or_create(key_file)
            lock = KeyFileLock(key_file)  # held until this process ends
        elif os.path.lexists(key_file):
            identity = PeerKey.load(key_file)
        else:
            identity = None
    except IdentityError as exc:
        print(f"moshpitd: peer key: {exc}", file=sys.stderr)
        return 2
    if check_only:
        print(json.dumps(settings.describe(), indent=2))
        if secrets[0] is not None:
            print(f"moshpitd: swarm key fingerprint {secrets[0].fingerprint}", file=sys.stderr)
        if identity is not None:
            print(f"moshpitd: peer id {identity.peer_id.hex()} (key file {key_file})",
                  file=sys.stderr)
        else:
            print(f"moshpitd: peer key file {key_file} (made at first start)", file=sys.stderr)
        print("moshpitd: configuration is valid", file=sys.stderr)
        return 0
    setup_logging(settings.log_level, settings.log_format)
    # The daemon's numpy work is small per call and runs on the event loop: BLAS thread pools
    # would only fight the other daemons and trainers for cores. Set before numpy loads, here
    # and not on import, so that a trainer importing a daemon module keeps its own setting.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from moshpitd.service import serve  # the heavy imports only once settings are valid

    assert identity is not None  # made or loaded above whenever the daemon starts
    log.info("peer id %s, key file %s", identity.peer_id.hex(), key_file)
    try:
        return run(serve(settings, *secrets, identity=identity))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
