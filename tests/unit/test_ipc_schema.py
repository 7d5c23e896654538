"""The IPC contract (moshpitd/ipc/schema.py): every op's messages survive the wire by name,
every malformed field is refused naming op and field, and every error code is raised as exactly
one client exception."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moshpit
from moshpit import errors as client_errors
from moshpit.client import _layout
from moshpitd.allreduce import robust
from moshpitd.allreduce.layout import FlatView, specs_from_wire
from moshpitd.ipc import schema as wire
from moshpitd.ipc.failures import error_code
from moshpitd.ipc.schema import ErrorCode, FieldError, IPCError
from moshpitd.matchmaking.errors import GroupNotFound, NoPartners, SchemaMismatch
from moshpitd.state import StateUnavailable

# one valid request and reply per op
SAMPLES: dict[str, tuple[wire.Message, wire.Message]] = {
    "hello": (wire.HelloRequest(protocol=wire.IPC_PROTOCOL),
              wire.HelloReply(peer_id="ab" * 20, version="0.1.0", protocol=wire.IPC_PROTOCOL)),
    "attach": (wire.AttachRequest(size=4096, buffer=3), wire.AttachReply(size=4096, buffer=3)),
    "average": (
        wire.AverageRequest(key="run", tensors=[["float32", [2, 3], 0], ["float16", [], 64]],
                            weight=2.5, timeout=7.0, group_size=4, min_group_size=2,
                            grid=[4, 2], rounds=2, initial_coords=[1, 3], codec="fp16",
                            aggregation="trimmed_mean", buffer=1, local_world=4, local_rank=3),
        wire.AverageReply(group_size=4, seconds=0.5, matchmaking_seconds=0.25,
                          bytes_sent=100, bytes_received=120, round=7, coords=[1, 3],
                          group_sizes=[4, 3], spans=[[0, 6, 15], [6, 7, 0]],
                          members=["aa", "bb", "cc", "dd"], owned=3, local_rank=3,
                          local_ranks=[0, 1, 2, 3])),
    "ready": (wire.ReadyRequest(request=17, abandon=True), wire.ReadyReply()),
    "publish_state": (
        wire.PublishStateRequest(key="run", tensors=[["float64", [5], 0]],
                                 meta={"names": ["param.0"], "step": 3}, version=9,
                                 timeout=3.0, buffer=2),
        wire.PublishStateReply(version=9, total=40)),
    "state_info": (wire.StateInfoRequest(key="run", timeout=4.0, version=9),
                   wire.StateInfoReply(total=40, version=9, tensors=[["float64", [5], 0]],
                                       meta={"step": 3}, donors=2)),
    "download_state": (
        wire.DownloadStateRequest(key="run", version=9, timeout=2.0, buffer=0),
        wire.DownloadStateReply(total=40, version=9, tensors=[["float64", [5], 0]],
                                meta={"step": 3}, donors=2, served_by=2)),
    "status": (wire.StatusRequest(), wire.StatusReply(status={"peer_id": "ab", "runs": {}},
                                                      metrics="127.0.0.1:9464", ipc="/s")),
    "rounds": (wire.RoundsRequest(), wire.RoundsReply(rounds=[{"key": "k", "seconds": 0.1}])),
    "peers": (wire.PeersRequest(), wire.PeersReply(contacts=[{"peer_id": "ab"}],
                                                   runs={"r": []})),
}


def through_the_wire(frame: dict[str, Any]) -> dict[str, Any]:
    out = msgpack.unpackb(msgpack.packb(frame, use_bin_type=True), raw=False)
    assert isinstance(out, dict)
    return out


def test_every_op_has_a_sample() -> None:
    assert set(SAMPLES) == set(wire.OPS)
    for op, (req, reply) in SAMPLES.items():
        assert type(req) is wire.OPS[op].request and type(reply) is wire.OPS[op].reply


@pytest.mark.parametrize("op", sorted(wire.OPS))
def test_round_trip_of_every_op(op: str) -> None:
    req, reply = SAMPLES[op]
    frame = through_the_wire(wire.request_frame(req, 17))
    assert frame["id"] == 17
    got_op, fields = wire.split_request(frame)
    assert got_op == op
    assert wire.decode(wire.OPS[op].request, fields) == req
    answer = through_the_wire(wire.reply_frame(17, reply))
    assert answer["ok"] is True and answer["id"] == 17
    assert wire.decode_reply(op, answer) == reply


def test_fields_are_decoded_by_name_not_position() -> None:
    _, reply = SAMPLES["average"]
    frame = wire.reply_frame(1, reply)
    shuffled = dict(reversed(list(frame.items())))
    assert wire.decode_reply("average", shuffled) == reply


def test_defaults_fill_fields_a_request_leaves_out() -> None:
    req = wire.decode(wire.AverageRequest, {"key": "k", "tensors": []})
    assert (req.weight, req.timeout, req.aggregation, req.buffer) == (1.0, 30.0, "mean", 0)
    assert wire.decode(wire.HelloRequest, {}).protocol == 1  # the unversioned protocol


def test_an_int_fits_a_float_field_and_becomes_one() -> None:
    req = wire.decode(wire.AverageRequest, {"key": "k", "tensors": [], "timeout": 5})
    assert req.timeout == 5.0 and isinstance(req.timeout, float)


def required(cls: type[wire.Message]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


MESSAGES = sorted({cls for spec in wire.OPS.values() for cls in (spec.request, spec.reply)},
                  key=lambda c: c.__name__)


def valid_fields(cls: type[wire.Message]) -> dict[str, Any]:
    for req, reply in SAMPLES.values():
        for msg in (req, reply):
            if type(msg) is cls:
                return wire.encode(msg)
    raise AssertionError(cls)


def wrong_value(hint: Any) -> Any:
    """A msgpack value that does not fit the type."""
    args = typing.get_args(hint)
    if hint is str or (args and str in args):
        return 5
    if hint in (int, float):
        return True  # a bool is not a number on this wire
    return "not-this-type"


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_missing_unknown_and_wrongly_typed_fields_name_op_and_field(
        cls: type[wire.Message]) -> None:
    good = valid_fields(cls)
    for name in required(cls):
        with pytest.raises(FieldError) as missing:
            wire.decode(cls, {k: v for k, v in good.items() if k != name})
        assert (missing.value.op, missing.value.field) == (cls.OP, name)
        assert str(missing.value) == f"{cls.OP}: field {name!r} is missing"
    with pytest.raises(FieldError, match=rf"^{cls.OP}: field 'surplus' is not a field"):
        wire.decode(cls, {**good, "surplus": 1})
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if hints[f.name] is Any:
            continue
        with pytest.raises(FieldError, match=rf"^{cls.OP}: field '{f.name}' has the wrong "
                                             "type") as wrong:
            wire.decode(cls, {**good, f.name: wrong_value(hints[f.name])})
        assert wrong.value.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("fields,field", [
    ({"key": ""}, "key"), ({"key": "k" * 257}, "key"),
    ({"weight": -1.0}, "weight"), ({"weight": float("nan")}, "weight"),
    ({"timeout": 0}, "timeout"), ({"timeout": 3600.5}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"group_size": 2, "min_group_size": 3}, "min_group_size"),
    ({"min_group_size": 0}, "min_group_size"),
    ({"grid": [4]}, "grid"), ({"grid": [4, 2], "rounds": 0}, "rounds"),
    ({"rounds": 2}, "rounds"), ({"initial_coords": [0]}, "initial_coords"),
    ({"aggregation": "median"}, "aggregation"), ({"buffer": 64}, "buffer"),
    ({"buffer": -1}, "buffer"), ({"tensors": [["float32", [1], 0]] * 100_001}, "tensors"),
    ({"grid": [4, 1.5]}, "grid"), ({"initial_coords": ["a"]}, "initial_coords"),
    ({"local_world": 0}, "local_world"), ({"local_world": 1025}, "local_world"),
    ({"local_rank": 0}, "local_rank"), ({"local_world": 2, "local_rank": 2}, "local_rank"),
    ({"local_world": 2, "local_rank": -1}, "local_rank"),
])
def test_out_of_range_average_fields_are_refused(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as exc:
        wire.decode(wire.AverageRequest, {"key": "k", "tensors": [], **fields})
    assert exc.value.field == field and str(exc.value).startswith(f"average: field {field!r}")


@pytest.mark.parametrize("cls,fields,field", [
    (wire.PublishStateRequest, {"version": 0}, "version"),
    (wire.PublishStateRequest, {"version": 1 << 63}, "version"),
    (wire.PublishStateRequest, {"timeout": -1}, "timeout"),
    (wire.StateInfoRequest, {"key": ""}, "key"),
    (wire.DownloadStateRequest, {"buffer": 99}, "buffer"),
    (wire.AttachRequest, {"size": 1, "buffer": 64}, "buffer"),
])
def test_out_of_range_state_fields_are_refused(cls: type[wire.Message], fields: dict[str, Any],
                                               field: str) -> None:
    base = {"key": "k", "tensors": []} if cls is wire.PublishStateRequest else {"key": "k"}
    if cls is wire.AttachRequest:
        base = {}
    with pytest.raises(FieldError) as exc:
        wire.decode(cls, {**base, **fields})
    assert exc.value.field == field


def test_a_reply_that_does_not_fit_is_a_protocol_error() -> None:
    frame = wire.reply_frame(1, SAMPLES["average"][1])
    del frame["owned"]
    with pytest.raises(FieldError, match="average: field 'owned' is missing") as exc:
        wire.decode_reply("average", frame)
    assert exc.value.code == ErrorCode.PROTOCOL_ERROR


@pytest.mark.parametrize("frame,message", [
    ({"id": 1}, "request: field 'op' must be a string"),
    ({"op": 7}, "request: field 'op' must be a string"),
    ({"op": "fly"}, "unknown op 'fly'"),
])
def test_requests_without_a_known_op_are_refused(frame: dict[str, Any], message: str) -> None:
    with pytest.raises(IPCError, match=message) as exc:
        wire.split_request(frame)
    assert exc.value.code == ErrorCode.INVALID_REQUEST


@given(st.dictionaries(st.text(max_size=6), st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
    st.lists(st.integers(), max_size=3)), max_size=6), st.sampled_from(MESSAGES))
def test_any_fields_decode_or_are_refused_cleanly(fields: dict[str, Any],
                                                  cls: type[wire.Message]) -> None:
    try:
        msg = wire.decode(cls, fields)
    except FieldError as exc:
        assert str(exc).startswith(f"{cls.OP}: field ")
    else:
        assert wire.decode(cls, through_the_wire(wire.encode(msg))) == msg


# --- error codes -----------------------------------------------------------------------------
def test_every_code_is_raised_as_exactly_one_client_exception_and_back() -> None:
    assert set(client_errors.BY_CODE) == set(ErrorCode)
    assert len(client_errors.CODED) == len(ErrorCode)  # no class twice, none without a code
    for code in ErrorCode:
        cls = client_errors.BY_CODE[code]
        assert cls.code is code
        exc = client_errors.from_reply(wire.error_frame(3, code, "why"))
        assert type(exc) is cls and str(exc) == f"{code}: why"
        assert getattr(moshpit, cls.__name__) is cls  # public


def test_local_errors_carry_the_rank_they_name() -> None:
    for cls in (moshpit.LocalRankMissing, moshpit.LocalMismatch):
        exc = client_errors.from_reply(wire.error_frame(1, cls.code, "rank 2", rank=2))
        assert type(exc) is cls and exc.rank == 2
    assert isinstance(moshpit.LocalMismatch("x"), moshpit.InvalidRequest)


def test_codes_are_stable_strings_not_class_names() -> None:
    for code in ErrorCode:
        assert code.value == code.name.lower()
    assert type(client_errors.from_reply({"ok": False, "error": "TimeoutError",
                                          "message": "x"})) is moshpit.MoshpitError


def test_a_timeout_is_named_by_its_op() -> None:
    """The daemon's choice for a TimeoutError depends on the op that ran out of time."""
    assert error_code("average", TimeoutError()) == ErrorCode.ROUND_TIMEOUT
    for op in ("publish_state", "state_info", "download_state"):
        assert error_code(op, TimeoutError()) == ErrorCode.STATE_UNAVAILABLE
    raised = client_errors.from_reply(wire.error_frame(
        1, error_code("average", TimeoutError()) or ErrorCode.INTERNAL_ERROR, "late"))
    assert isinstance(raised, moshpit.RoundTimeout)
    assert not isinstance(raised, moshpit.StateUnavailable)


@pytest.mark.parametrize("op,exc,code", [
    ("average", NoPartners("alone"), ErrorCode.GROUP_NOT_FOUND),
    ("average", GroupNotFound("none"), ErrorCode.GROUP_NOT_FOUND),
    ("average", SchemaMismatch("shapes"), ErrorCode.SCHEMA_MISMATCH),
    ("average", ValueError("over the limit"), ErrorCode.INVALID_REQUEST),
    ("average", StateUnavailable("not a round's"), None),
    ("download_state", StateUnavailable("gone"), ErrorCode.STATE_UNAVAILABLE),
    ("download_state", GroupNotFound("not a state op's"), None),
    ("peers", TimeoutError(), None),
    ("status", IPCError(ErrorCode.SHUTTING_DOWN, "bye"), ErrorCode.SHUTTING_DOWN),
    ("average", RuntimeError("a bug"), None),
])
def test_failures_get_their_op_s_code(op: str, exc: BaseException,
                                      code: ErrorCode | None) -> None:
    assert error_code(op, exc) == code


# --- constants defined once ------------------------------------------------------------------
def test_shared_constants_have_one_definition() -> None:
    assert robust.AGGREGATIONS is wire.AGGREGATIONS
    assert moshpit.AGGREGATIONS is wire.AGGREGATIONS


def test_client_layout_and_daemon_snapshot_align_tensors_alike() -> None:
    tensors = [torch.ones(3), torch.ones(5, dtype=torch.float64), torch.ones(7, 1)]
    specs, size = _layout(tensors)
    buf = bytearray(size)
    _, packed = FlatView(memoryview(buf), specs_from_wire(specs)).pack()
    assert [s[2] for s in packed] == [s[2] for s in specs]
    assert all(s[2] % wire.BUFFER_ALIGN == 0 for s in specs)
    assert [wire.aligned(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    assert np.frombuffer(buf, np.uint8).size == size


def test_the_schema_imports_nothing_but_the_stdlib() -> None:
    code = ("import sys, moshpitd.ipc.schema; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'torch', 'msgpack', 'grpc', 'kademlia') or m.startswith('moshpitd')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["moshpitd", "moshpitd.ipc", "moshpitd.ipc.errors",
                                      "moshpitd.ipc.message", "moshpitd.ipc.schema"])
