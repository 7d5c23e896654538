"""A daemon option, declared once, and the value types an option may take.

An option is a field of `moshpitd.config.Settings` made with `option()`: its name is the field's,
its type a `Kind` (how a value is read from TOML, the environment or a flag, checked against
bounds, and written back), plus a default, a doc line and the section it is listed under. The
file key, the `MOSHPITD_*` variable, the flag, `--check-config`'s output, the example file and
the settings table in docs/operator.md are all computed from that one declaration.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

ENV_PREFIX = "MOSHPITD_"
OPTION = "moshpitd.option"  # the key of a Settings field's metadata that holds its Option

T = TypeVar("T")
HostPort = tuple[str, int]


def parse_hostport(text: str) -> HostPort:
    """host:port or [v6]:port; port 0 means any free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"port of {text!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port {number} of {text!r} is out of range 0..65535")
    return host, number


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Kind(Generic[T]):
    """How values of one type are read (`parse`: a TOML value, or a string from the
    environment or a flag), shown in `--check-config` (`show`: JSON that `parse` takes back),
    written in TOML, and described to people (`text`, `bounds`)."""

    form = ""  # how the value is written where that is not obvious (the table says it)

    def metavar(self) -> str:
        return "VALUE"

    def parse(self, value: Any) -> T:
        raise NotImplementedError

    def show(self, value: T) -> Any:
        return value

    def toml(self, value: T) -> str:
        return json.dumps(self.show(value), ensure_ascii=False)

    def text(self, value: T) -> str:
        return str(self.show(value))

    def bounds(self) -> str:
        return ""


class HostPortKind(Kind[HostPort]):
    def metavar(self) -> str:
        return "HOST:PORT"

    def parse(self, value: Any) -> HostPort:
        if not isinstance(value, str):
            raise ValueError(f"expected a \"HOST:PORT\" string, got {type(value).__name__}")
        return parse_hostport(value)

    def show(self, value: HostPort) -> str:
        return format_hostport(*value)


class HostPortsKind(Kind[list[HostPort]]):
    form = "a TOML array of \"HOST:PORT\"; comma-separated in the environment and the flag"

    def parse(self, value: Any) -> list[HostPort]:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            raise ValueError("expected a list of \"HOST:PORT\" strings, got "
                             f"{type(value).__name__}")
        return [HOSTPORT.parse(v) for v in value]

    def metavar(self) -> str:
        return "HOST:PORT[,HOST:PORT...]"

    def show(self, value: list[HostPort]) -> list[str]:
        return [format_hostport(*v) for v in value]

    def text(self, value: list[HostPort]) -> str:
        return ",".join(self.show(value)) or "none"


def _binary(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Int(Kind[int]):
    lo: int
    hi: int
    unit: str = ""  # "bytes" prints as KiB, MiB...

    def metavar(self) -> str:
        return "BYTES" if self.unit == "bytes" else "N"

    def parse(self, value: Any) -> int:
        if isinstance(value, str):
            value = int(value.strip(), 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise ValueError(f"{value} is outside {self.lo}..{self.hi}")
        return value

    def text(self, value: int) -> str:
        return _binary(value) if self.unit == "bytes" else str(value)

    def bounds(self) -> str:
        return f"{self.text(self.lo)} .. {self.text(self.hi)}"


@dataclass(frozen=True)
class Float(Kind[float]):
    lo: float
    hi: float
    open_low: bool = False  # lo itself is not allowed
    unit: str = ""  # "s": seconds

    def metavar(self) -> str:
        return "SECONDS" if self.unit == "s" else "NUMBER"

    def parse(self, value: Any) -> float:
        if isinstance(value, str):
            value = float(value.strip())
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        value = float(value)
        low_ok = self.lo < value if self.open_low else self.lo <= value
        if not low_ok or not value <= self.hi:
            raise ValueError(f"{value} is outside {'(' if self.open_low else '['}{self.lo}, "
                             f"{self.hi}]")
        return value

    def toml(self, value: float) -> str:
        return repr(float(value))

    def text(self, value: float) -> str:
        return f"{value:g} s" if self.unit == "s" else f"{value:g}"

    def bounds(self) -> str:
        if self.open_low:
            return f"more than {self.text(self.lo)}, at most {self.text(self.hi)}"
        return f"{self.text(self.lo)} .. {self.text(self.hi)}"


class BoolKind(Kind[bool]):
    def parse(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = value.strip().lower() if isinstance(value, str) else None
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"expected true or false, got {value!r}")

    def text(self, value: bool) -> str:
        return "true" if value else "false"


@dataclass(frozen=True)
class Str(Kind[str]):
    meta: str = "TEXT"  # what the string names: PATH, HOST, NAME

    def metavar(self) -> str:
        return self.meta

    def parse(self, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return value

    def text(self, value: str) -> str:
        return json.dumps(value, ensure_ascii=False) if value else "empty"


@dataclass(frozen=True)
class Choice(Kind[str]):
    choices: tuple[str, ...]
    upper: bool = False  # values are upper case (and read in any case)

    def metavar(self) -> str:
        return "{" + ",".join(self.choices) + "}"

    def parse(self, value: Any) -> str:
        text = STR.parse(value).strip()
        text = text.upper() if self.upper else text.lower()
        if text not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        return text

    def bounds(self) -> str:
        return "one of " + ", ".join(self.choices)


HOSTPORT = HostPortKind()
HOSTPORTS = HostPortsKind()
BOOL = BoolKind()
STR = Str()


@dataclass(frozen=True)
class Option:
    """One option. `doc` is one or two sentences (flag help, README table); `note` adds what an
    operator editing the example file should know; `example` is the value the example file
    sets (None: the default)."""

    key: str
    kind: Kind[Any]
    default: Any
    section: str
    doc: str
    note: str = ""
    example: Any = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return isinstance(self.kind, BoolKind)

    def parse(self, value: Any) -> Any:
        return self.kind.parse(value)

    def example_value(self) -> Any:
        return self.default if self.example is None else self.kind.parse(self.example)

    def summary(self) -> str:
        """The default and the bounds, for people: "default 1 MiB; 4 KiB .. 64 MiB"."""
        parts = [f"default {self.kind.text(self.default)}"]
        if self.kind.bounds():
            parts.append(self.kind.bounds())
        return "; ".join(parts)


def option(kind: Kind[T], default: T, section: str, doc: str, *, note: str = "",
           example: Any = None) -> T:
    """Declare a `Settings` field as an option. Typed as the value (a dataclass field in fact),
    so the type checker holds the field's annotation, the kind and the default to one type."""
    spec = Option("", kind, default, section, doc, note, example)
    metadata = {OPTION: spec}
    made: Any
    if isinstance(default, list):
        items = list(default)
        made = dataclasses.field(default_factory=lambda: list(items), metadata=metadata)
    else:
        made = dataclasses.field(default=default, metadata=metadata)
    return cast(T, made)


def declared(cls: type) -> tuple[Option, ...]:
    """The options of a dataclass, in declaration order, each named after its field."""
    return tuple(dataclasses.replace(f.metadata[OPTION], key=f.name)
                 for f in dataclasses.fields(cls) if OPTION in f.metadata)


def sections(options: Sequence[Option]) -> list[tuple[str, list[Option]]]:
    """Options grouped by section, sections in the order they first appear."""
    grouped: dict[str, list[Option]] = {}
    for o in options:
        grouped.setdefault(o.section, []).append(o)
    return list(grouped.items())
