"""The example config file and the settings table are what the option declarations render:
an option added, removed or changed without regenerating them fails here."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from moshpitd import config_docs
from moshpitd.config import OPTIONS, load
from moshpitd.config_docs import (
    EXAMPLE_FILE,
    TABLE_BEGIN,
    TABLE_END,
    marked_blocks,
    render_example,
    render_table,
)

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `python -m moshpitd.config_docs` from the project's root"


def test_example_file_is_what_the_declarations_render() -> None:
    assert (ROOT / EXAMPLE_FILE).read_text() == render_example(), FIX


def test_settings_table_in_the_docs_is_what_the_declarations_render() -> None:
    blocks = marked_blocks(ROOT)
    assert blocks, f"no {TABLE_BEGIN} ... {TABLE_END} block in README.md or docs/*.md"
    for path, block in blocks.items():
        assert block == render_table(), f"{path.relative_to(ROOT)}: {FIX}"


def test_example_file_sets_every_key_to_a_valid_value(tmp_path: Path) -> None:
    text = render_example()
    values = tomllib.loads(text)
    assert list(values) == [o.key for o in OPTIONS]
    path = tmp_path / "moshpitd.toml"
    path.write_text(text)
    settings = load({}, {}, str(path))
    for o in OPTIONS:
        assert getattr(settings, o.key) == o.example_value(), o.key
        assert f"env {o.env}, flag {o.flag}" in text.replace("#\n# ", "").replace("\n# ", " ")


def test_table_has_a_row_per_option_with_default_and_bounds() -> None:
    rows = render_table().splitlines()[2:]
    assert len(rows) == len(OPTIONS)
    for o, row in zip(OPTIONS, rows, strict=True):
        assert row.startswith(f"| `{o.key}` | ") and row.endswith(" |"), row
        assert row.count(" | ") == 1, row  # no stray cell separator from a doc's text
        assert f"Default {o.kind.text(o.default)}" in row, row
        assert o.kind.bounds() in row, row
    timeout = rows[[o.key for o in OPTIONS].index("dht_rpc_timeout")]
    assert "Default 1 s; 0.05 s .. 60 s." in timeout


def copy_project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "deploy").mkdir(parents=True)
    (root / "docs").mkdir()
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / EXAMPLE_FILE, root / EXAMPLE_FILE)
    return root


def test_the_table_is_found_and_rewritten_wherever_it_moves(tmp_path: Path) -> None:
    root = copy_project(tmp_path)
    stale = "| key | meaning |\n| --- | --- |\n| `part_size` | old text |\n"
    block = f"{TABLE_BEGIN}\n{stale}{TABLE_END}"
    # the table may live in README.md or move to any docs/*.md: here it is in operator.md only
    (root / "README.md").write_text("# moshpit\n\nSettings: see docs/operator.md\n")
    (root / "docs" / "operator.md").write_text(f"# Operating\n\n{block}\n\nAfter.\n")
    (root / EXAMPLE_FILE).write_text("part_size = 1\n")
    found = marked_blocks(root)
    assert found == {root / "docs" / "operator.md": stale}  # the drift a test would catch
    assert config_docs.main([str(root)]) == 0
    assert marked_blocks(root) == {root / "docs" / "operator.md": render_table()}
    text = (root / "docs" / "operator.md").read_text()
    assert text.startswith("# Operating\n\n" + TABLE_BEGIN) and text.endswith(
        TABLE_END + "\n\nAfter.\n")
    assert (root / EXAMPLE_FILE).read_text() == render_example()
    assert config_docs.write(root) == []  # rendering again changes nothing


def test_without_a_marked_table_the_writer_says_so(tmp_path: Path) -> None:
    root = copy_project(tmp_path)
    (root / "README.md").write_text("# no table\n")
    assert config_docs.main([str(root)]) == 2
