"""Logging: text for people, one JSON object per line for log shippers."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# attributes every LogRecord has; anything else came in through `extra=` and is kept
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message",
                                                                           "asctime"}


class JsonFormatter(logging.Formatter):
    """`extra=` fields become JSON fields, so a round's numbers need no parsing."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _NoDecodeNoise(logging.Filter):
    """grpc logs a traceback at ERROR for every request body it cannot deserialize; anyone can
    send those (moshpitd_auth_rejected_total counts the unauthenticated ones)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "deserializ" in record.getMessage():
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ in ("AuthError", "DecodeError"))


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("kademlia").setLevel(max(logging.WARNING, root.level))
    for name in ("grpc._cython.cygrpc", "grpc._server", "grpc.aio._server"):
        logging.getLogger(name).addFilter(_NoDecodeNoise())
    # rpcudp logs every unanswered datagram at ERROR; moshpitd_dht_rpcs_total counts them
    logging.getLogger("rpcudp").setLevel(logging.CRITICAL)
