"""Fuzzing daemon 0's IPC socket with hypothesis-generated frames (see tests/fuzz)."""

from __future__ import annotations

import array
import fcntl
import math
import os
import re
import select
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moshpitd.ipc.schema import IPC_PROTOCOL, ErrorCode
from tests.fuzz.strategies import MAX_FRAME, either, floats, ints, texts, values
from tests.fuzz.target import FUZZ, LURE_TENSORS, SESSION_END_TIMEOUT, Target, live_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from live_target(tmp_path_factory)


OPS = ["hello", "attach", "average", "ready", "status", "rounds", "peers", "publish_state",
       "state_info", "download_state"]
dtypes = st.sampled_from(["float32", "float16", "float64", "int64", "bfloat16", "", "float32\0"])
shapes = st.one_of(st.lists(st.integers(-2, 70), max_size=3), st.lists(ints, max_size=3),
                   st.lists(st.integers(0, 2), min_size=32, max_size=34))
offsets = st.one_of(st.sampled_from([0, 0, 2, 4, 64, 4096, 65536]), ints)
tensor = either(st.tuples(dtypes, shapes, offsets).map(list))
MANY_TENSORS = [["float32", [1], 4 * i] for i in range(100_001)]  # one over the limit
tensor_lists = st.one_of(
    st.lists(tensor, max_size=4),
    st.just(LURE_TENSORS),
    st.sampled_from([[], MANY_TENSORS[:100_000], MANY_TENSORS]),
    values)
IPC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "id": either(ints, texts),
    "key": either(st.sampled_from(["fuzz-ipc", "k", "a" * 256, "a" * 257, ""]), texts),
    "tensors": tensor_lists,
    "size": either(st.sampled_from([4096, 65536, 0, -1, 16 << 30, (16 << 30) + 1]), ints),
    "buffer": either(st.integers(-2, 66), ints),
    "weight": either(floats, ints),
    "timeout": either(st.floats(0.001, 2.0), floats, ints),
    "group_size": either(st.integers(-1, 1100), ints),
    "min_group_size": either(st.integers(-1, 1100), ints),
    "grid": either(st.lists(st.integers(-1, 40), max_size=3), st.lists(ints, max_size=3),
                   st.none()),
    "rounds": either(st.integers(-1, 1001), ints),
    "initial_coords": either(st.lists(st.integers(-1, 40), max_size=4), st.none()),
    "codec": either(st.sampled_from(["none", "fp16", "bf16", "int8", "gzip", ""])),
    "meta": either(st.dictionaries(st.text(max_size=8), values, max_size=4)),
    "version": either(ints, st.none()),
    "protocol": either(st.sampled_from([IPC_PROTOCOL, 1, IPC_PROTOCOL + 1]), ints),
    "pending": either(st.booleans()),
    "request": either(st.integers(0, 1000), ints, texts),
    "abandon": either(st.booleans()),
}
ops = st.one_of(st.sampled_from(OPS), st.sampled_from(OPS), st.sampled_from(OPS),
                st.text(max_size=20), values)
# keys of the fuzz cases' own: never the keys the checks, the lure or the state use
ipc_keys = st.one_of(st.sampled_from(["fuzz-ipc", "fuzz-ipc-2"]), st.text(
    min_size=1, max_size=12).map(lambda k: "fuzz-ipc/" + k))
small_tensors = st.lists(st.tuples(st.sampled_from(["float32", "float16", "float64"]),
                                   st.lists(st.integers(0, 16), max_size=2))
                         .map(lambda t: [t[0], t[1]]), min_size=1, max_size=3)


def lay_out(tensors: list[list[Any]]) -> list[list[Any]]:
    """[dtype, shape] -> [dtype, shape, offset], packed and aligned as a trainer would."""
    out, offset = [], 0
    for dtype, shape in tensors:
        out.append([dtype, shape, offset])
        offset += 8 * math.prod(shape)
    return out


@st.composite
def plausible_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A request the daemon would accept, then up to three fields fuzzed."""
    op = draw(st.sampled_from(OPS))
    key = draw(ipc_keys)
    timeout = draw(st.floats(0.01, 2.0))
    tensors = lay_out(draw(small_tensors))
    templates: dict[str, dict[str, Any]] = {
        "hello": {"protocol": IPC_PROTOCOL}, "status": {}, "rounds": {}, "peers": {},
        "attach": {"size": draw(st.sampled_from([4096, 65536])), "buffer": 0},
        "average": {"key": key, "tensors": tensors, "timeout": timeout, "weight": 1.0,
                    "group_size": 2, "min_group_size": 2, "buffer": 0, "codec": "none",
                    "pending": draw(st.booleans())},
        "ready": {"request": draw(st.integers(0, 1000)), "abandon": draw(st.booleans())},
        "publish_state": {"key": key, "tensors": tensors, "meta": {"step": 1}, "buffer": 0,
                          "timeout": timeout},
        "state_info": {"key": key, "timeout": timeout},
        "download_state": {"key": key, "timeout": timeout, "buffer": 0},
    }
    msg = {"op": op, "id": draw(st.integers(0, 1000)), **templates[op]}
    if op == "average" and draw(st.booleans()):
        msg.update(grid=[2, draw(st.integers(1, 3))], rounds=draw(st.integers(1, 3)))
    for name in draw(st.lists(st.sampled_from(sorted(IPC_FIELDS)), max_size=3, unique=True)):
        msg[name] = draw(IPC_FIELDS[name])
    return msg


messages = st.one_of(plausible_messages(), plausible_messages(), st.builds(
    lambda base, extra, keep_op: {**extra, **base} if keep_op else
    {k: v for k, v in {**extra, **base}.items() if k != "op"},
    st.fixed_dictionaries({"op": ops}, optional=IPC_FIELDS),
    st.dictionaries(st.text(max_size=8), values, max_size=2),
    st.integers(0, 15).map(bool)))


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def pack(obj: Any) -> bytes:
    try:
        return bytes(msgpack.packb(obj, use_bin_type=True))
    except (ValueError, OverflowError, TypeError):  # beyond msgpack: send a stand-in
        return b"\xc1"


# a session starts with hello: most cases say it first, so that their requests get past it
HELLO = frame(pack({"op": "hello", "id": 0, "protocol": IPC_PROTOCOL}))
greeting = st.sampled_from([HELLO, HELLO, HELLO, b""])

# msgpack the packer will not write: bombs, deep nesting, ext types, reserved bytes
crafted_payloads = st.sampled_from([
    b"\xdd\xff\xff\xff\xff",                      # array of 2^32-1 items, none present
    b"\x81\xa2op\xdd\x00\x0f\xff\xff" + b"\x00" * 64,
    b"\xdf\xff\xff\xff\xff\xa2op",                # map of 2^32-1 pairs
    b"\x81\xa2op\xdb\xff\xff\xff\xff",            # str of 4 GiB announced
    b"\x81\xa2op" + b"\x91" * 3000 + b"\xc0",     # nesting deeper than the unpacker's stack
    b"\x81\xa2op" + b"\x91" * 500 + b"\xa5hello",
    b"\x82\xa2op\xa5hello\xa2id\xd4\x01\x00",     # ext type as the id
    b"\x82\xa2op\xa5hello\xa2id\xd6\xff\x00\x00\x00\x01",  # timestamp as the id
    b"\x81\x01\xa5hello",                          # int map key
    b"\x81\xc4\x02op\xa5hello",                    # bin map key
    b"\x81\xa2op\xa5hel\xff\xfe",                  # invalid UTF-8
    b"\x81\xa2op\xc1",                             # reserved byte
    b"\x81\xa2op\xa5hello\xc0",                    # trailing data
    b"\x80", b"\xc0", b"\x90", b"",
])
payloads = st.one_of(messages.map(pack), messages.map(pack), crafted_payloads,
                     st.binary(max_size=64))
# a memfd the trainer may pass: (actual size, sealed against shrinking)
memfds = st.tuples(st.one_of(st.sampled_from([4096, 65536]), st.integers(1, 65536)),
                   st.integers(0, 9).map(bool))
attach_frames = st.builds(
    lambda size, buffer: frame(pack({"op": "attach", "size": size, "buffer": buffer, "id": -1})),
    st.one_of(st.sampled_from([4096, 4096, 65536]), st.integers(0, 70_000), ints),
    st.one_of(st.just(0), st.just(0), st.integers(-1, 64)))
framed = st.builds(lambda rest: b"".join(frame(p) for p in rest),
                   st.lists(payloads, min_size=1, max_size=3))
# a trainer that attaches a memfd first, then asks for things
with_buffer = st.tuples(st.builds(lambda h, a, rest: h + a + rest, greeting, attach_frames,
                                  framed), memfds)
bogus_lengths = st.one_of(st.sampled_from([0, 1, MAX_FRAME, MAX_FRAME + 1, (1 << 32) - 1,
                                           1 << 31]), st.integers(0, (1 << 32) - 1))
bodies = st.one_of(payloads, st.binary(max_size=256), st.builds(
    bytes, st.sampled_from([MAX_FRAME - 1, MAX_FRAME, MAX_FRAME + 1, 70_000])))
bogus = st.builds(lambda n, body: n.to_bytes(4, "big") + body, bogus_lengths, bodies)
no_fd = st.builds(lambda h, rest: h + rest, greeting, st.one_of(
    st.binary(min_size=1, max_size=2048), framed, framed, bogus,
    st.binary(min_size=1, max_size=3),  # a partial length prefix
    st.builds(lambda a, b: a + b, framed, bogus)))
ipc_cases = st.one_of(st.tuples(no_fd, st.none()), st.tuples(no_fd, st.none()), with_buffer,
                      st.tuples(no_fd, memfds))  # a descriptor nobody asked for


def make_memfd(size: int, sealed: bool) -> int:
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def parse_ipc_replies(data: bytes) -> list[dict[str, Any]]:
    """Every reply is a whole frame holding a map with a boolean "ok"; errors say what."""
    out, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= 4, f"truncated reply header: {data[pos:]!r}"
        size = int.from_bytes(data[pos:pos + 4], "big")
        pos += 4
        assert size <= len(data) - pos, f"reply of {size} bytes cut at {len(data) - pos}"
        reply = msgpack.unpackb(data[pos:pos + size], raw=False)
        pos += size
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            assert isinstance(reply.get("error"), str), reply
            assert isinstance(reply.get("message"), str), reply
            assert reply["error"] in set(ErrorCode), reply
            assert reply["error"] != ErrorCode.INTERNAL_ERROR, f"daemon error: {reply}"
        out.append(reply)
    return out


def run_ipc_case(t: Target, data: bytes, memfd: tuple[int, bool] | None) -> list[dict[str, Any]]:
    """Connect, send (reading replies meanwhile, as the daemon may answer before it has read
    everything), hang up, read until the daemon closes the session."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = make_memfd(*memfd) if memfd is not None else None
    try:
        sock.connect(t.daemon.socket)
        sock.setblocking(False)
        rest = memoryview(data)
        received = bytearray()
        hung_up = None  # when we shut our side
        deadline = time.monotonic() + SESSION_END_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            readable, writable, _ = select.select([sock], [] if hung_up else [sock], [],
                                                  max(left, 0))
            if not readable and not writable:
                raise AssertionError(
                    f"the daemon kept the session open {SESSION_END_TIMEOUT} s "
                    f"({'after the trainer hung up' if hung_up else 'and stopped reading'}); "
                    f"received so far {bytes(received[:300])!r}")
            if readable:
                try:
                    chunk = sock.recv(1 << 16)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    break
                received += chunk
            if writable:
                try:
                    if fd is not None:  # the descriptor goes with the first bytes
                        sent = sock.sendmsg([rest[:1 << 16]], [(
                            socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                        os.close(fd)
                        fd = None
                    else:
                        sent = sock.send(rest[:1 << 16])
                    rest = rest[sent:]
                    if not rest:
                        sock.shutdown(socket.SHUT_WR)
                        hung_up = time.monotonic()
                except (BrokenPipeError, ConnectionResetError):
                    # it closed on a framing error before reading everything: allowed
                    hung_up = time.monotonic()
        if hung_up:
            t.slowest_session_end = max(t.slowest_session_end, time.monotonic() - hung_up)
    finally:
        sock.close()
        if fd is not None:
            os.close(fd)
    return parse_ipc_replies(bytes(received))


def test_fuzz_ipc(target: Target) -> None:
    @FUZZ
    @given(case=ipc_cases)
    def fuzz(case: tuple[bytes, tuple[int, bool] | None]) -> None:
        replies = run_ipc_case(target, *case)
        for r in replies:
            target.stats[f"ipc {'ok' if r['ok'] else r['error']}"] += 1
        target.after_case()

    fuzz()
    target.check("after IPC fuzzing")


def test_unknown_ops_add_no_metric_series(target: Target) -> None:
    """Requests with made-up ops cost an error reply, not memory: /metrics keeps one series
    per real op (an unknown one counts as "invalid" or "unknown")."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(target.daemon.socket)
        for i in range(300):
            sock.sendall(frame(pack({"op": f"no-such-op-{i}", "id": i})))
        replies = b""
        while replies.count(b"unknown op") < 300:
            replies += sock.recv(1 << 16)
    with urllib.request.urlopen(f"http://{target.daemon.info['metrics']}/metrics") as resp:
        text = resp.read().decode()
    ops = set(re.findall(r'moshpitd_ipc_requests_total\{op="([^"]*)"', text))
    assert ops <= {*OPS, "invalid", "unknown"}, f"{len(ops)} op labels, e.g. {sorted(ops)[:5]}"

