"""The documents computed from the option declarations (moshpitd/config.py): the commented
example file deploy/moshpitd.toml and the settings table of the operator's documentation.

`python -m moshpitd.config_docs` rewrites both from the declarations, run from the project's
root; tests/unit/test_config_docs.py fails when either has drifted from them.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from moshpitd.config import DEFAULT_CONFIG, OPTIONS
from moshpitd.option import Option, sections

EXAMPLE_FILE = Path("deploy/moshpitd.toml")
TABLE_BEGIN = "<!-- options:begin -->"
TABLE_END = "<!-- options:end -->"
TABLE_FILES = ("README.md", "docs/*.md")  # where the marked table may live
WIDTH = 99

EXAMPLE_HEADER = f"""\
# moshpitd configuration: {DEFAULT_CONFIG} (read with `moshpitd --config PATH`).
# Written by `python -m moshpitd.config_docs` from the declarations in moshpitd/config.py.
#
# Every key can also be given
#   - in the environment as MOSHPITD_<KEY> (upper case), e.g. MOSHPITD_ADVERTISE_HOST=203.0.113.7,
#     MOSHPITD_BOOTSTRAP=10.0.0.1:7700,10.0.0.2:7700, MOSHPITD_CLIENT_MODE=true;
#   - on the command line as --<key with dashes>, e.g. --advertise-host 203.0.113.7.
# Precedence: flags > environment > this file > built-in defaults.
# Unknown keys are an error, so a typo cannot silently fall back to a default.
# `moshpitd --check-config --config PATH` validates a file without starting the daemon.
"""


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH - 2, initial_indent="# ", subsequent_indent="# ",
                         break_on_hyphens=False, break_long_words=False)


def example_entry(o: Option) -> list[str]:
    """One key of the example file: what it is, its default and bounds, the value."""
    text = _sentence(o.doc) + (" " + o.note if o.note else "")
    lines = _comment(text)
    lines += _comment(_sentence(f"{o.summary()}; env {o.env}, flag {o.flag}"))
    lines.append(f"{o.key} = {o.kind.toml(o.example_value())}")
    return lines


def render_example(options: Sequence[Option] = OPTIONS) -> str:
    """The commented example file: every key, grouped by section."""
    out = [EXAMPLE_HEADER.rstrip("\n")]
    for title, members in sections(options):
        out += ["", f"# --- {title} ".ljust(WIDTH, "-")]
        for o in members:
            out += ["", *example_entry(o)]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table_row(o: Option) -> str:
    meaning = _sentence(o.doc)
    if o.kind.form:
        meaning += f" Written as {o.kind.form}."
    if o.is_bool:
        meaning += f" Flags `{o.flag}` / `--no-{o.flag[2:]}`."
    return f"| `{o.key}` | {_cell(meaning)} {_cell(_sentence(o.summary()))} |"


def render_table(options: Sequence[Option] = OPTIONS) -> str:
    """The settings as a Markdown table: key | meaning, with the default and the bounds."""
    rows = ["| key | meaning |", "| --- | --- |", *(table_row(o) for o in options)]
    return "\n".join(rows) + "\n"


def table_files(root: Path) -> list[Path]:
    """The documents that may hold the marked table."""
    found: list[Path] = []
    for pattern in TABLE_FILES:
        found += sorted(root.glob(pattern))
    return [p for p in found if p.is_file()]


def marked_blocks(root: Path) -> dict[Path, str]:
    """The text between the markers in each document that has them."""
    out: dict[Path, str] = {}
    for path in table_files(root):
        text = path.read_text()
        if TABLE_BEGIN not in text:
            continue
        start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
        end = text.index(TABLE_END, start)
        out[path] = text[start:end].strip("\n") + "\n"
    return out


def write(root: Path) -> list[Path]:
    """Rewrite the example file and every marked table; returns the files changed."""
    changed: list[Path] = []
    example = root / EXAMPLE_FILE
    if example.read_text() != render_example():
        example.write_text(render_example())
        changed.append(example)
    table = render_table()
    for path, block in marked_blocks(root).items():
        if block != table:
            text = path.read_text()
            start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
            end = text.index(TABLE_END, start)
            path.write_text(text[:start] + "\n" + table + text[end:])
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    root = Path(argv[0] if argv else ".")
    if not (root / EXAMPLE_FILE).exists():
        print(f"run from the project's root: {root / EXAMPLE_FILE} not found", file=sys.stderr)
        return 2
    if not marked_blocks(root):
        print(f"no {TABLE_BEGIN} ... {TABLE_END} block in {', '.join(TABLE_FILES)}",
              file=sys.stderr)
        return 2
    for path in write(root):
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
