"""Scenario files (bench/scenarios/*.toml): the emulated network and its event schedule.

    name = "wan"                 # defaults to the file's stem
    description = "..."
    hosts = 4                    # default host count (--hosts overrides)
    budget_s = 150               # default time budget per system (--budget overrides)
    trainers_per_host = 1        # trainer processes per host, sharing its cgroup (default 1;
                                 # past 1, only the systems in MULTI_TRAINER_SYSTEMS run)

    [[host]]                     # one table per host; with more hosts than tables, host i gets
    rate_mbit = 200              # table i mod len (so a 4-host file scales to 8 hosts)
    delay_ms = 10                # added to what this host receives (see netlab)
    loss_pct = 0.5               # of the packets this host receives

    [[event]]                    # times are fractions of the budget
    kind = "preempt"             # SIGKILL all of a host's processes at `at`, bring it back at
    host = -1                    # `until` (omit: never); negative hosts count from the end
    at = 0.333
    until = 0.667

    [[event]]
    kind = "rate"                # the host's link runs at `factor` x its rate from at to until
    host = 1
    factor = 0.25
    at = 0.4
    until = 0.7

Unknown keys are errors, so a typo never silently runs a different scenario.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netlab.links import LinkSpec

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
DEFAULT_SCENARIOS = ("lan", "wan", "churn")
EVENT_KINDS = ("preempt", "rate")
MAX_TRAINERS_PER_HOST = 8  # each trainer of a host takes its own daemon ports in moshpit-each


class ScenarioError(ValueError):
    """A scenario file is malformed (the message names the file and the key)."""


@dataclass(frozen=True)
class Event:
    kind: str
    host: int  # as written: negative counts from the end
    at: float  # fraction of the budget
    until: float | None = None
    factor: float = 1.0

    def host_index(self, hosts: int) -> int:
        index = self.host + hosts if self.host < 0 else self.host
        if not 0 <= index < hosts:
            raise ScenarioError(f"event {self.kind} names host {self.host}, but there are "
                                f"{hosts} hosts")
        return index


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    hosts: int
    budget_s: float
    links: tuple[LinkSpec, ...]  # as written; `links_for(hosts)` cycles them
    events: tuple[Event, ...]
    path: Path | None = None
    trainers_per_host: int = 1

    def links_for(self, hosts: int) -> list[LinkSpec]:
        return [self.links[i % len(self.links)] for i in range(hosts)]

    def check_hosts(self, hosts: int) -> None:
        for event in self.events:
            event.host_index(hosts)
        preempted = {e.host_index(hosts) for e in self.events if e.kind == "preempt"}
        if len(preempted) >= hosts:
            raise ScenarioError(f"{self.name}: every host is preempted; one must stay up")


def _take(table: dict[str, Any], where: str, allowed: dict[str, type | tuple[type, ...]]
          ) -> dict[str, Any]:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {unknown} (allowed: {sorted(allowed)})")
    for key, value in table.items():
        kinds = allowed[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ScenarioError(f"{where}: {key} = {value!r} has the wrong type")
    return table


def _number(key: str) -> tuple[str, tuple[type, ...]]:
    return key, (int, float)


def parse(data: dict[str, Any], name: str, path: Path | None = None) -> Scenario:
    where = str(path or name)
    top = _take(data, where, dict([("name", str), ("description", str), ("hosts", int),
                                   _number("budget_s"), ("host", list), ("event", list),
                                   ("trainers_per_host", int)]))
    host_tables = top.get("host", [])
    if not host_tables:
        raise ScenarioError(f"{where}: needs at least one [[host]] table")
    links = []
    for i, table in enumerate(host_tables):
        if not isinstance(table, dict):
            raise ScenarioError(f"{where}: host {i} is not a table")
        spec = _take(table, f"{where} host {i}", dict([_number("rate_mbit"),
                                                       _number("delay_ms"),
                                                       _number("loss_pct")]))
        if "rate_mbit" not in spec:
            raise ScenarioError(f"{where} host {i}: rate_mbit is required")
        try:
            links.append(LinkSpec(float(spec["rate_mbit"]), float(spec.get("delay_ms", 0)) / 1e3,
                                  float(spec.get("loss_pct", 0))))
        except ValueError as exc:
            raise ScenarioError(f"{where} host {i}: {exc}") from exc
    events = []
    for i, table in enumerate(top.get("event", [])):
        if not isinstance(table, dict):
            raise ScenarioError(f"{where}: event {i} is not a table")
        spec = _take(table, f"{where} event {i}", dict([("kind", str), ("host", int),
                                                        _number("at"), _number("until"),
                                                        _number("factor")]))
        for key in ("kind", "host", "at"):
            if key not in spec:
                raise ScenarioError(f"{where} event {i}: {key} is required")
        kind = spec["kind"]
        if kind not in EVENT_KINDS:
            raise ScenarioError(f"{where} event {i}: kind {kind!r} is not one of {EVENT_KINDS}")
        at = float(spec["at"])
        until = float(spec["until"]) if "until" in spec else None
        if not 0 <= at < 1 or (until is not None and not at < until <= 1):
            raise ScenarioError(f"{where} event {i}: need 0 <= at < until <= 1 (fractions of "
                                f"the budget), got at={at} until={until}")
        factor = float(spec.get("factor", 1.0))
        if kind == "rate" and not factor > 0:
            raise ScenarioError(f"{where} event {i}: factor must be positive")
        if kind == "preempt" and "factor" in spec:
            raise ScenarioError(f"{where} event {i}: a preempt event takes no factor")
        events.append(Event(kind, int(spec["host"]), at, until, factor))
    hosts = int(top.get("hosts", 4))
    budget = float(top.get("budget_s", 150.0))
    if hosts < 2 or budget <= 0:
        raise ScenarioError(f"{where}: need hosts >= 2 and budget_s > 0")
    trainers = int(top.get("trainers_per_host", 1))
    if not 1 <= trainers <= MAX_TRAINERS_PER_HOST:
        raise ScenarioError(f"{where}: trainers_per_host must be in 1..{MAX_TRAINERS_PER_HOST}, "
                            f"not {trainers}")
    scenario = Scenario(top.get("name", name), top.get("description", ""), hosts, budget,
                        tuple(links), tuple(events), path, trainers)
    scenario.check_hosts(hosts)
    return scenario


def load(path_or_name: str | Path) -> Scenario:
    """A scenario from a file, or by name from bench/scenarios (`wan` -> wan.toml)."""
    path = Path(path_or_name)
    if not path.exists() and path.suffix == "" and (SCENARIO_DIR / f"{path}.toml").exists():
        path = SCENARIO_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ScenarioError(f"no scenario file {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    return parse(data, path.stem, path)
