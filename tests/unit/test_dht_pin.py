"""moshpitd/dht/protocol.py uses rpcudp's private RPCProtocol internals; setup.cfg pins rpcudp
exactly, and this fails the moment an installed version differs or the names move."""

from __future__ import annotations

import asyncio
import configparser
import importlib.metadata
import inspect
from pathlib import Path

from rpcudp.protocol import RPCProtocol

SETUP = Path(__file__).resolve().parents[2] / "setup.cfg"


def test_installed_rpcudp_is_the_pinned_one() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(SETUP)
    pins = [line.strip() for line in cfg["options"]["install_requires"].splitlines()
            if line.strip().startswith("rpcudp")]
    assert pins == [f"rpcudp=={importlib.metadata.version('rpcudp')}"], pins


def test_private_names_we_rely_on_exist() -> None:
    async def make() -> RPCProtocol:
        return RPCProtocol(wait_timeout=3)

    proto = asyncio.run(make())
    assert proto._wait_timeout == 3
    assert isinstance(proto._outstanding, dict)
    params = list(inspect.signature(proto._accept_response).parameters)
    assert params == ["msg_id", "data", "address"], params
