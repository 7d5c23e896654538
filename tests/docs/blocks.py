"""The code blocks of README.md and docs/*.md, and how the example tests run each one.

A fenced block whose language is python, sh, bash, shell or console is an example: the tests
run it. An HTML comment on the line before the fence (blank lines between are allowed) says how:

- `<!-- not-run: REASON -->`: exempt (systemctl, kubectl, long benchmarks, a GPU torchrun);
  the reason is required.
- `<!-- run: trainers=N -->` (python): N copies run at once, trainer i talking to daemon i of a
  shared swarm through `MOSHPIT_SOCKET`; each of their daemons must then have recorded a
  round that averaged with a peer. Without it one copy runs, on the swarm's last daemon.
  `same-output` (with trainers=N): every copy must print the same thing (a consensus).
  `per-host=K` (with trainers=N): K trainers share each daemon, as torchrun starts them on one
  host: trainer i talks to daemon i // K with LOCAL_RANK=i % K and LOCAL_WORLD_SIZE=K.
- `<!-- run: until "REGEX" -->` (shell): the block runs until stopped, like a daemon in the
  foreground; once its output matches REGEX it gets SIGINT (Ctrl-C) and must exit 0.

Other languages (text, toml, yaml, promql, json, and none) are not examples. Any other
language is an error, so that no example escapes the tests by its label.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = frozenset({"python"})
SHELL = frozenset({"sh", "bash", "shell", "console"})
NOT_EXAMPLES = frozenset({"", "text", "toml", "yaml", "promql", "json", "ini"})

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|run)\s*:(?P<body>.*?)-->\s*$")
# A marker's words: a "quoted string" (backslash escapes allowed) or a bare word.
WORD = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')


class DocError(ValueError):
    """A document's blocks or markers are malformed: names the file and line."""


@dataclass(frozen=True)
class Marker:
    kind: str  # "not-run" or "run"
    text: str  # the reason (not-run) or the options (run)
    line: int
    options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: Marker | None = None

    @property
    def where(self) -> str:
        try:
            name = self.path.relative_to(ROOT)
        except ValueError:
            name = self.path
        return f"{name}:{self.line}"

    @property
    def is_example(self) -> bool:
        return self.lang in PYTHON or self.lang in SHELL

    @property
    def exempt(self) -> bool:
        return self.marker is not None and self.marker.kind == "not-run"

    @property
    def trainers(self) -> int:
        return int(self.marker.options.get("trainers", "1")) if self.marker else 1

    @property
    def per_host(self) -> int:
        return int(self.marker.options.get("per-host", "1")) if self.marker else 1

    @property
    def same_output(self) -> bool:
        return self.marker is not None and "same-output" in self.marker.options

    @property
    def until(self) -> str | None:
        return self.marker.options.get("until") if self.marker else None


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md: the documents whose examples must run."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _options(marker_text: str, where: str) -> dict[str, str]:
    """`trainers=2` or `until "REGEX"`: the options a run marker may carry."""
    words = WORD.findall(marker_text)
    options: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "until":
            if i + 1 >= len(words) or not words[i + 1].startswith('"'):
                raise DocError(f"{where}: `until` needs a quoted regular expression")
            pattern = words[i + 1][1:-1].replace('\\"', '"')
            try:
                re.compile(pattern)
            except re.error as exc:
                raise DocError(f"{where}: bad regular expression {pattern!r}: {exc}") from None
            options["until"] = pattern
            i += 2
            continue
        if word == "same-output":
            options[word] = "yes"
            i += 1
            continue
        name, sep, value = word.partition("=")
        if name not in ("trainers", "per-host") or not sep or not value.isdigit() \
                or not 1 <= int(value) <= 4:
            raise DocError(f"{where}: unknown run option {word!r} (trainers=1..4, "
                           f"per-host=1..4, same-output, until \"REGEX\")")
        options[name] = value
        i += 1
    return options


def parse(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a markdown file, each with the marker just above it."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    pending: Marker | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{path}:{i + 1}"
        m = MARKER.match(line)
        if m:
            if pending is not None:
                raise DocError(f"{path}:{pending.line}: marker not followed by a code block")
            text = m["body"].strip()
            if m["kind"] == "not-run":
                if not text:
                    raise DocError(f"{where}: `not-run` needs a reason")
                pending = Marker("not-run", text, i + 1)
            else:
                pending = Marker("run", text, i + 1, _options(text, where))
            i += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and pending is not None:
                raise DocError(f"{path}:{pending.line}: marker not followed by a code block")
            i += 1
            continue
        start, indent, mark = i + 1, len(fence["indent"]), fence["fence"]
        lang = fence["info"].strip().split(" ")[0].lower() if fence["info"].strip() else ""
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(mark[0] * len(mark)) and not close.strip(mark[0]):
                break
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        else:
            raise DocError(f"{where}: code block never closed")
        blocks.append(Block(path, start, lang, "\n".join(body) + "\n", pending))
        pending = None
        i += 1
    if pending is not None:
        raise DocError(f"{path}:{pending.line}: marker not followed by a code block")
    return blocks


def check(blocks: list[Block]) -> list[str]:
    """What is wrong with the blocks' labels and markers: [] when every example runs or is
    exempt with a reason, and every marker fits its block."""
    problems = []
    for b in blocks:
        if not b.is_example and b.lang not in NOT_EXAMPLES:
            problems.append(f"{b.where}: unknown language {b.lang!r}: label it python, sh, "
                            f"bash or console (run) or text (not an example)")
        elif not b.is_example and b.marker is not None:
            problems.append(f"{b.where}: a marker on a {b.lang or 'plain'} block, which is "
                            f"never run")
        elif b.marker is not None and b.marker.kind == "run":
            if "trainers" in b.marker.options and b.lang not in PYTHON:
                problems.append(f"{b.where}: trainers= is for python examples")
            if "until" in b.marker.options and b.lang not in SHELL:
                problems.append(f"{b.where}: until is for shell examples")
            if "same-output" in b.marker.options and b.trainers < 2:
                problems.append(f"{b.where}: same-output needs trainers=2 or more")
            if "per-host" in b.marker.options and (b.trainers % b.per_host
                                                   or b.trainers // b.per_host < 2):
                problems.append(f"{b.where}: per-host=K needs trainers=N, a multiple of K "
                                "with N/K >= 2 (hosts to average between)")
    return problems


def shell_script(block: Block) -> str:
    """The commands of a shell block; for console, the `$ ` lines and their continuations
    (the rest is output)."""
    if block.lang != "console":
        return block.code
    out: list[str] = []
    continued = False
    for line in block.code.splitlines():
        if continued or line.startswith("$ "):
            command = line if continued else line[2:]
            out.append(command)
            continued = command.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


@dataclass
class Substitutions:
    """How a shell example written for a real machine runs on the test machine.

    - `/run/moshpitd/moshpitd.sock` is the socket of the swarm daemon the example talks to;
      in an example that starts its own daemon (`until`), `/run/moshpitd/` is a fresh
      directory instead.
    - `127.0.0.1:9464` (the default metrics address) is that daemon's metrics address.
    - `/etc/moshpitd/` is a fresh directory.
    - Hosts `10.0.0.N` are `127.0.0.N` (Linux routes all of 127/8 to loopback), and the fixed
      ports 7700, 7701, 7702 are free ports chosen for the run.
    """

    socket: str
    metrics: str
    run_dir: Path
    etc_dir: Path
    ports: dict[int, int]
    own_daemon: bool = False

    def apply(self, script: str) -> str:
        if self.own_daemon:
            script = script.replace("/run/moshpitd/", f"{self.run_dir}/")
        else:
            script = script.replace("/run/moshpitd/moshpitd.sock", self.socket)
            script = script.replace("127.0.0.1:9464", self.metrics)
        script = script.replace("/etc/moshpitd/", f"{self.etc_dir}/")
        script = re.sub(r"\b10\.0\.0\.(\d{1,3})\b", r"127.0.0.\1", script)
        for fixed, free in self.ports.items():
            script = re.sub(rf":{fixed}\b", f":{free}", script)
        return script
