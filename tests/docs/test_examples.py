"""Every python and shell example of README.md and docs/*.md runs, against real daemons where
it talks to one (tests/docs/blocks.py says how blocks are marked, runner.py how they run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moshpitd.launcher import LocalSwarm
from tests.docs.blocks import Block, check, doc_files, parse
from tests.docs.runner import run

BLOCKS = [b for path in doc_files() for b in parse(path)]
EXAMPLES = [b for b in BLOCKS if b.is_example and not b.exempt]


def test_every_example_runs_or_is_exempt() -> None:
    assert not check(BLOCKS), "\n".join(check(BLOCKS))
    assert EXAMPLES, "no examples found: the extraction is broken"


def test_documents_link_each_other() -> None:
    """The front page reaches every document, and no relative link is broken."""
    readme = doc_files()[0]
    text = readme.read_text()
    for doc in doc_files()[1:]:
        assert f"docs/{doc.name}" in text, f"README.md does not link docs/{doc.name}"
    for doc in doc_files():
        for target in _relative_links(doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    return [t for t in links if "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.where for b in EXAMPLES])
def test_example(block: Block, docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    run(block, docs_swarm, tmp_path)
