"""Messages of the IPC contract as frozen dataclasses, and how a frame's fields become one:
by name, each checked against its declared type, then the message's own range checks. The
messages themselves are declared in moshpitd/ipc/schema.py."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from moshpitd.ipc.errors import ErrorCode, FieldError

REQUIRED: Any = dataclasses.MISSING


class Message:
    """Base of every request and reply: `OP` names the op it belongs to."""

    OP: ClassVar[str] = ""

    def validate(self) -> None:
        """Range checks beyond types (types are checked by `decode`)."""


M = TypeVar("M", bound=Message)
Check = Callable[[Any], tuple[bool, Any]]  # (fits, the value as the field holds it)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else hint.__name__


def _check(hint: Any) -> Check:
    """How a decoded msgpack value is checked against a field's type: an int fits a float
    field (and becomes a float), a bool fits only a bool field. Built once per field."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v: (True, v)
    if origin in (typing.Union, types.UnionType):
        arms = [_check(arm) for arm in typing.get_args(hint)]

        def union(v: Any) -> tuple[bool, Any]:
            for arm in arms:
                fits, out = arm(v)
                if fits:
                    return True, out
            return False, v
        return union
    if hint is type(None):
        return lambda v: (v is None, v)
    if hint is float:
        return lambda v: ((True, float(v)) if isinstance(v, int | float)
                          and not isinstance(v, bool) else (False, v))
    if hint is bool:
        return lambda v: (isinstance(v, bool), v)
    if origin is list:
        (elem,) = typing.get_args(hint)
        if elem is Any:
            return lambda v: (isinstance(v, list), v)
        item = _check(elem)
        if float not in (elem, *typing.get_args(elem)):  # items stay as they are: no copy
            return lambda v: (isinstance(v, list) and all(item(x)[0] for x in v), v)

        def items(v: Any) -> tuple[bool, Any]:
            if not isinstance(v, list):
                return False, v
            out = []
            for x in v:
                fits, x = item(x)
                if not fits:
                    return False, v
                out.append(x)
            return True, out
        return items
    if origin is dict:
        return lambda v: (isinstance(v, dict) and all(isinstance(k, str) for k in v), v)
    return lambda v: (isinstance(v, hint) and not isinstance(v, bool), v)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    check: Check
    required: bool
    type_name: str


_FIELDS: dict[type, dict[str, _Field]] = {}


def _fields(cls: type) -> dict[str, _Field]:
    known = _FIELDS.get(cls)
    if known is None:
        hints = typing.get_type_hints(cls)
        known = _FIELDS[cls] = {f.name: _Field(
            f.name, _check(hints[f.name]),
            f.default is REQUIRED and f.default_factory is REQUIRED,
            _type_name(hints[f.name])) for f in dataclasses.fields(cls)}
    return known


def decode(cls: type[M], fields: dict[str, Any],
           code: ErrorCode = ErrorCode.INVALID_REQUEST) -> M:
    """A message from a frame's fields (the envelope's op, id and ok already taken out)."""
    op = cls.OP
    known = _fields(cls)
    for name in fields:
        if name not in known:
            raise FieldError(op, str(name), "is not a field of this op", code)
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in fields:
            if f.required:
                raise FieldError(op, name, "is missing", code)
            continue
        fits, value = f.check(fields[name])
        if not fits:
            raise FieldError(op, name, f"has the wrong type ({type(fields[name]).__name__}, "
                             f"expected {f.type_name})", code)
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
    return {name: getattr(msg, name) for name in _fields(type(msg))}
