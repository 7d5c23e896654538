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
    """The front page reaches every document, and no relative link or anchor is broken."""
    readme = doc_files()[0]
    text = readme.read_text()
    for doc in doc_files()[1:]:
        assert f"docs/{doc.name}" in text, f"README.md does not link docs/{doc.name}"
    for doc in doc_files():
        for target, anchor in _relative_links(doc.read_text()):
            path = (doc.parent / target) if target else doc
            assert path.exists(), f"{doc.name}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path.read_text()), f"{doc.name}: no #{anchor} in {path}"


def _relative_links(text: str) -> list[tuple[str, str]]:
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)
    return [(t, a) for t, a in links if "://" not in t and not t.startswith("mailto:")]


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", re.sub(r"```.*?```", "", text, flags=re.S),
                          flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.where for b in EXAMPLES])
def test_example(block: Block, docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    run(block, docs_swarm, tmp_path)
