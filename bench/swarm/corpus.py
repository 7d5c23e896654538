"""The benchmark's text: the reStructuredText sources of the Python documentation.

They come from the Debian package python3-doc (make system-deps installs it), so a run needs no
download. The directory is found by glob, not by a fixed Python version; the split into training
and validation is by file (a hash of each file's path), so it is fixed for a given package and
no document leaks from one side to the other.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCES_GLOB = "/usr/share/doc/python3*/html/_sources"
# Overrides the glob (a directory of *.rst.txt files), e.g. on a system without python3-doc.
ENV_DIR = "MOSHPIT_SWARM_CORPUS"
VALIDATION_EVERY = 10  # one file in ten (by path hash) is validation text


class CorpusNotFound(RuntimeError):
    """No Python documentation sources on this machine."""


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 arrays) and where they came from."""

    root: Path
    train: np.ndarray
    validation: np.ndarray
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]


def _version(path: str) -> tuple[int, ...]:
    found = re.search(r"python(\d+)\.(\d+)", path)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def find_sources() -> Path:
    """The documentation sources: $MOSHPIT_SWARM_CORPUS, else the newest python3.X's (the
    /usr/share/doc/python3*/ names are symlinks to a few real directories)."""
    override = os.environ.get(ENV_DIR)
    if override:
        root = Path(override)
        if not root.is_dir():
            raise CorpusNotFound(f"{ENV_DIR}={override} is not a directory")
        return root
    real = {os.path.realpath(d) for d in glob.glob(SOURCES_GLOB) if os.path.isdir(d)}
    if not real:
        raise CorpusNotFound(f"no Python documentation sources under {SOURCES_GLOB}: install "
                             "the Debian package python3-doc (make system-deps does, as root)")
    return Path(max(real, key=lambda d: (_version(d), d)))


def is_validation(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % VALIDATION_EVERY == 0


@functools.lru_cache(maxsize=2)
def load_corpus(root: Path | None = None) -> Corpus:
    """Every *.rst.txt under the sources, in path order, split by file."""
    root = find_sources() if root is None else root
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.rst.txt")
                   if p.is_file())
    if not files:
        raise CorpusNotFound(f"{root} holds no *.rst.txt files")
    train = [f for f in files if not is_validation(f)]
    valid = [f for f in files if is_validation(f)]
    if not train or not valid:
        raise CorpusNotFound(f"{root} holds too few files ({len(files)}) to split")

    def concat(names: list[str]) -> np.ndarray:
        return np.frombuffer(b"".join((root / n).read_bytes() for n in names), dtype=np.uint8)

    return Corpus(root, concat(train), concat(valid), tuple(train), tuple(valid))


def unigram_entropy(data: np.ndarray) -> float:
    """Entropy of the byte distribution of `data`, in nats: the loss of the best model that
    ignores context, the yardstick for "the model learnt something"."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
