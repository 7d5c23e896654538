"""The demo's text: the Python documentation's sources that bench.swarm trains on, or, where
the Debian package python3-doc is missing, the pydoc topics that ship with Python itself.

Every trainer reads the directory chosen here through bench.swarm.corpus's own override
(MOSHPIT_SWARM_CORPUS), so that the demo and the results benchmark split, batch and validate
one text the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.swarm.corpus import ENV_DIR, CorpusNotFound, find_sources

INSTALL_HINT = "sudo apt-get install python3-doc"


@dataclass(frozen=True)
class DemoText:
    root: Path  # a directory of *.rst.txt files, for load_corpus
    name: str  # what it is, for the output
    missing: str | None = None  # why python3-doc's sources are not used, and how to get them


def choose_text(workdir: Path, pydoc_topics: bool = False) -> DemoText:
    """python3-doc's sources (or $MOSHPIT_SWARM_CORPUS), else the pydoc topics written under
    workdir."""
    missing = None
    if not pydoc_topics:
        try:
            root = find_sources()
        except CorpusNotFound as exc:
            missing = (f"{exc}\n  to train on the Python documentation rather than the "
                       f"pydoc topics: {INSTALL_HINT}")
        else:
            return DemoText(root, f"the Python documentation's sources, {root}")
    root = write_pydoc_topics(workdir / "pydoc-topics")
    return DemoText(root, f"Python's pydoc topics (pydoc_data.topics), written to {root}",
                    missing)


def write_pydoc_topics(root: Path) -> Path:
    """One file per topic of pydoc_data.topics (about 0.5 MB of the language reference in
    plain text), so that load_corpus splits them by file like python3-doc's pages."""
    from pydoc_data.topics import topics  # imported here: 0.5 MB of strings

    root.mkdir(parents=True, exist_ok=True)
    for name, text in topics.items():
        (root / f"{name}.rst.txt").write_bytes(text.encode())
    return root


def trainer_env(text: DemoText) -> dict[str, str]:
    """The environment entry that points bench.swarm.corpus at the chosen text."""
    return {ENV_DIR: str(text.root)}
