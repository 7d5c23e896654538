"""The extraction and marker rules (tests/docs/blocks.py), on made-up documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import Block, DocError, Substitutions, check, parse, shell_script

DOC = Path("/doc.md")


def blocks(text: str) -> list[Block]:
    return parse(DOC, text)


def test_blocks_languages_lines_and_markers() -> None:
    found = blocks(
        "# t\n\n```python\nprint(1)\n```\n\n<!-- not-run: needs a GPU -->\n```sh\nnvidia-smi\n"
        "```\n\n<!-- run: trainers=3 -->\n\n```python\nx = 1\n```\n\n```text\ndiagram\n```\n"
        "  ```bash\n  echo indented\n  ```\n")
    assert [(b.line, b.lang) for b in found] == [(3, "python"), (8, "sh"), (14, "python"),
                                                (18, "text"), (21, "bash")]
    assert found[0].code == "print(1)\n" and found[0].marker is None
    assert found[1].exempt and found[1].marker is not None
    assert found[1].marker.text == "needs a GPU"
    assert found[2].trainers == 3 and not found[2].exempt
    assert not found[3].is_example
    assert found[4].code == "echo indented\n"
    assert check(found) == []


def test_unknown_language_is_a_problem() -> None:
    problems = check(blocks("```py\nprint(1)\n```\n```zsh\nls\n```\n"))
    assert len(problems) == 2 and "unknown language 'py'" in problems[0]


def test_markers_must_fit_their_block() -> None:
    assert "trainers= is for python" in check(blocks(
        "<!-- run: trainers=2 -->\n```sh\nls\n```\n"))[0]
    assert "until is for shell" in check(blocks(
        '<!-- run: until "x" -->\n```python\nx = 1\n```\n'))[0]
    assert "never run" in check(blocks("<!-- not-run: why -->\n```toml\na = 1\n```\n"))[0]
    assert "same-output needs" in check(blocks(
        "<!-- run: same-output -->\n```python\nx = 1\n```\n"))[0]
    assert "per-host=K needs trainers=N" in check(blocks(
        "<!-- run: trainers=3 per-host=2 -->\n```python\nx = 1\n```\n"))[0]
    assert "per-host=K needs trainers=N" in check(blocks(
        "<!-- run: trainers=2 per-host=2 -->\n```python\nx = 1\n```\n"))[0]
    (two_hosts,) = blocks("<!-- run: trainers=4 per-host=2 -->\n```python\nx = 1\n```\n")
    assert two_hosts.per_host == 2 and check([two_hosts]) == []


@pytest.mark.parametrize("text, message", [
    ("<!-- not-run: -->\n```sh\nls\n```\n", "needs a reason"),
    ("<!-- not-run: x -->\nsome prose\n```sh\nls\n```\n", "not followed by a code block"),
    ("<!-- not-run: x -->\n", "not followed by a code block"),
    ("<!-- run: trainers=9 -->\n```python\nx\n```\n", "unknown run option"),
    ("<!-- run: fast -->\n```python\nx\n```\n", "unknown run option"),
    ("<!-- run: until x -->\n```sh\nls\n```\n", "quoted regular expression"),
    ('<!-- run: until "(" -->\n```sh\nls\n```\n', "bad regular expression"),
    ("```sh\nls\n", "never closed"),
])
def test_malformed_markers_and_fences(text: str, message: str) -> None:
    with pytest.raises(DocError, match=message):
        blocks(text)


def test_until_pattern_keeps_escaped_quotes() -> None:
    (block,) = blocks('<!-- run: until "\\"name\\": \\"d3\\"" -->\n```sh\nx\n```\n')
    assert block.until == '"name": "d3"'


def test_console_keeps_commands_and_drops_output() -> None:
    (block,) = blocks("```console\n$ moshpit status \\\n    --json\n{\"peer_id\": 1}\n$ ls\n"
                      "a b\n```\n")
    assert shell_script(block) == "moshpit status \\\n    --json\nls\n"


def test_substitutions(tmp_path: Path) -> None:
    script = ("moshpitd --dht-listen 10.0.0.5:7700 --grpc-listen 10.0.0.5:7701 "
              "--bootstrap 10.0.0.4:7700 --ipc-socket /run/moshpitd/moshpitd.sock\n"
              "curl -s 127.0.0.1:9464/metrics; cat /etc/moshpitd/moshpitd.toml; echo :77001\n")
    subs = Substitutions("/s/d0.sock", "127.0.0.1:4242", tmp_path / "run", tmp_path / "etc",
                         {7700: 40000, 7701: 40001, 7702: 40002})
    assert subs.apply(script) == (
        "moshpitd --dht-listen 127.0.0.5:40000 --grpc-listen 127.0.0.5:40001 "
        "--bootstrap 127.0.0.4:40000 --ipc-socket /s/d0.sock\n"
        f"curl -s 127.0.0.1:4242/metrics; cat {tmp_path}/etc/moshpitd.toml; echo :77001\n")
    subs.own_daemon = True
    assert f"--ipc-socket {tmp_path}/run/moshpitd.sock" in subs.apply(script)
    assert "127.0.0.1:9464" in subs.apply(script)  # its own daemon: not the swarm's metrics
