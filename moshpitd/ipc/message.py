"""Messages of the IPC contract as frozen dataclasses, and how a frame's fields become one:
by name, each checked against its declared type, then the message's own range checks. The
messages themselves are declared in moshpitd/ipc/schema.py."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar

from moshpitd.ipc.errors import ErrorCode, FieldError

REQUIRED: Any = dataclasses.MISSING


class Message:
    """Base of every request and reply: `OP` names the op it belongs to."""

    OP: ClassVar[str] = ""

    def validate(self) -> None:
        """Range checks beyond types (types are checked by `decode`)."""


M = TypeVar("M", bound=Message)
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else hint.__name__


def _conform(value: Any, hint: Any) -> tuple[bool, Any]:
    """(fits, value) for a decoded msgpack value and a field's type; an int fits a float
    field (and becomes a float), a bool fits only a bool field."""
    if hint is Any:
        return True, value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            fits, out = _conform(value, arm)
            if fits:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if isinstance(value, bool) and hint is not bool:
        return False, value
    if hint is float:
        return (True, float(value)) if isinstance(value, int | float) else (False, value)
    if origin is list:
        if not isinstance(value, list):
            return False, value
        (elem,) = typing.get_args(hint)
        if elem is Any:
            return True, value
        out = []
        for item in value:
            fits, item = _conform(item, elem)
            if not fits:
                return False, value
            out.append(item)
        return True, out
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value), value
    return isinstance(value, hint), value


def decode(cls: type[M], fields: dict[str, Any],
           code: ErrorCode = ErrorCode.INVALID_REQUEST) -> M:
    """A message from a frame's fields (the envelope's op, id and ok already taken out)."""
    op = cls.OP
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name in fields:
        if name not in known:
            raise FieldError(op, str(name), "is not a field of this op", code)
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in fields:
            if f.default is REQUIRED and f.default_factory is REQUIRED:
                raise FieldError(op, name, "is missing", code)
            continue
        fits, value = _conform(fields[name], hints[name])
        if not fits:
            raise FieldError(op, name, f"has the wrong type ({type(fields[name]).__name__}, "
                             f"expected {_type_name(hints[name])})", code)
        values[name] = value
    msg = cls(**values)
    try:
        msg.validate()
    except FieldError as exc:
        exc.code = code
        raise
    return msg


def encode(msg: Message) -> dict[str, Any]:
    """The message's fields by name (a shallow copy: msgpack packs the values as they are)."""
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}  # type: ignore
