"""The example runner fails when an example fails: made-up blocks against the real swarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from moshpitd.launcher import LocalSwarm
from tests.docs.blocks import Block, parse
from tests.docs.runner import ExampleFailed, processes_naming, run

DOC = Path("/doc.md")


def block(text: str) -> Block:
    (found,) = parse(DOC, text)
    return found


@pytest.mark.parametrize("text, message", [
    ("```sh\necho partial output\nfalse\necho never\n```\n", "exited with 1"),
    ("```sh\ncat /etc/moshpitd/missing.toml\n```\n", "exited with 1"),
    ("```python\nraise SystemExit(3)\n```\n", "exited with 3"),
    ("```python\nimport moshpit\nmoshpit.Client('/nonexistent.sock')\n```\n", "exited with 1"),
], ids=["sh-false", "sh-missing-file", "python-exit-3", "python-no-daemon"])
def test_a_failing_example_fails(text: str, message: str, docs_swarm: LocalSwarm,
                                 tmp_path: Path) -> None:
    with pytest.raises(ExampleFailed, match=message):
        run(block(text), docs_swarm, tmp_path)


def test_trainers_that_never_average_fail(docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    example = block("<!-- run: trainers=2 -->\n```python\nimport moshpit\nprint('hi')\n```\n")
    with pytest.raises(ExampleFailed, match="recorded no round that averaged with a peer"):
        run(example, docs_swarm, tmp_path)


def test_until_needs_its_output_and_a_clean_exit(docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    with pytest.raises(ExampleFailed, match="never matched"):
        run(block('<!-- run: until "ready" -->\n```sh\necho starting\n```\n'), docs_swarm,
            tmp_path / "a")
    ignores_sigint = block('<!-- run: until "ready" -->\n```sh\ntrap "exit 5" INT\n'
                           'echo ready\nwhile true; do sleep 0.05; done\n```\n')
    with pytest.raises(ExampleFailed, match="exited with 5 after SIGINT"):
        run(ignores_sigint, docs_swarm, tmp_path / "b")


def test_shell_examples_see_the_swarm_daemon(docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    """The substitutions hold: the documented socket path is a live daemon's."""
    (outcome,) = run(block("```sh\ntest -S /run/moshpitd/moshpitd.sock\n"
                           "echo /run/moshpitd/moshpitd.sock $MOSHPIT_SOCKET\n```\n"),
                     docs_swarm, tmp_path)
    assert outcome.output.split() == [docs_swarm.daemons[0].socket] * 2
    assert not processes_naming(tmp_path)


def test_same_output_needs_the_same_output(docs_swarm: LocalSwarm, tmp_path: Path) -> None:
    example = block("<!-- run: trainers=2 same-output -->\n```python\nimport os\n"
                    "import torch\nimport moshpit\n"
                    "client = moshpit.Client(os.environ['MOSHPIT_SOCKET'])\n"
                    "client.average([torch.zeros(4)], key='same-output-check')\n"
                    "print(os.getpid())\n```\n")
    with pytest.raises(ExampleFailed, match="printed different things"):
        run(example, docs_swarm, tmp_path)
