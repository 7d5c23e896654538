"""Fuzzing daemon 0's gRPC server with hypothesis-generated messages (see tests/fuzz)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moshpit
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.proto import moshpit_pb2 as pb
from tests.fuzz.strategies import U64, endpoints, floats, texts
from tests.fuzz.target import (
    DOWNLOAD_STATE,
    FUZZ,
    HEALTH_CHECK,
    JOIN,
    KNOWN_BUGS,
    LURE_KEY,
    LURE_SCHEMA,
    STATE_KEY,
    Target,
    grpc_decode_error,
    live_target,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from live_target(tmp_path_factory)


U32 = (1 << 32) - 1
join_fields: dict[str, st.SearchStrategy[Any]] = {
    "group_key": st.one_of(st.just(LURE_KEY), st.just(LURE_KEY), st.just(""), st.text(
        max_size=24), texts),
    "peer_id": st.one_of(st.binary(min_size=20, max_size=20), st.binary(max_size=40),
                         st.builds(bytes, st.sampled_from([19, 21, 70_000]))),
    "endpoint": endpoints,
    "schema_hash": st.one_of(st.just(LURE_SCHEMA), st.just(LURE_SCHEMA), st.binary(
        max_size=20)),
    "weight": st.one_of(st.floats(0, 10), floats),
    "client_mode": st.booleans(),
    "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), st.just(PROTOCOL_VERSION),
                                  st.sampled_from([0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1,
                                                   U32]),
                                  st.integers(0, U32)),
    "data_endpoint": endpoints,
    "bandwidth": st.one_of(st.floats(0, 10), floats),
    "codec": st.one_of(st.just("none"), st.just("none"), st.sampled_from(
        ["fp16", "bf16", "int8", "", "zip"]), st.text(max_size=8)),
}


@st.composite
def join_requests(draw: st.DrawFn) -> pb.JoinRequest:
    """A Join the lure's leader would accept, with up to four fields fuzzed."""
    fields: dict[str, Any] = {
        "group_key": LURE_KEY, "peer_id": draw(st.binary(min_size=20, max_size=20)),
        "endpoint": "127.0.0.1:1", "schema_hash": LURE_SCHEMA, "weight": 1.0,
        "protocol_version": PROTOCOL_VERSION, "data_endpoint": draw(endpoints), "bandwidth": 1.0,
        "codec": "none"}
    for name in draw(st.lists(st.sampled_from(sorted(join_fields)), max_size=4, unique=True)):
        fields[name] = draw(join_fields[name])
    return pb.JoinRequest(**fields)


u64 = st.one_of(st.sampled_from([0, 1, 1 << 20, (1 << 20) - 1, (1 << 20) + 1, 2_400_040,
                                 2_400_039, 2_400_041, (3 << 20) + 1, 1 << 32, (1 << 63) - 1,
                                 1 << 63, U64]), st.integers(0, U64))
# version None: the version daemon 0 published, filled in when the case runs
state_requests = st.fixed_dictionaries({
    "key": st.one_of(st.just(STATE_KEY), st.just(STATE_KEY), st.just(STATE_KEY), st.just(""),
                     st.text(max_size=16)),
    "offset": u64, "length": u64,
    "version": st.one_of(st.none(), st.none(), st.none(), st.just(0), u64)})


def state_request(kw: dict[str, Any], version: int = 0) -> pb.StateRequest:
    return pb.StateRequest(**{**kw, "version": version if kw["version"] is None
                              else kw["version"]})


def mutate(data: bytes, cut: int, pos: int, byte: int, tail: bytes) -> bytes:
    """A serialized message, cut short or with one byte changed, plus random bytes."""
    if data and cut % 3 == 0:
        data = data[:cut % len(data)]
    elif data and cut % 3 == 1:
        i = pos % len(data)
        data = data[:i] + bytes([byte]) + data[i + 1:]
    return data + tail


@dataclass(frozen=True)
class GrpcCase:
    method: str
    request: pb.JoinRequest | dict[str, Any] | None  # a StateRequest's fields; None: raw bytes
    raw: bytes = b""
    signer: int | None = None  # a Join signed (when the case runs) by FUZZ_KEYS[signer]


# Joins must prove their peer id: these keys sign some cases, so that fuzzed joins still reach
# the leader's group (and become members with broken endpoints), not only its refusals.
FUZZ_KEYS = [PeerKey.generate() for _ in range(3)]


def as_signer(request: pb.JoinRequest, signer: int) -> GrpcCase:
    request.peer_id = FUZZ_KEYS[signer].peer_id
    return GrpcCase(JOIN, request, signer=signer)


def raw_case(method: str, msgs: st.SearchStrategy[Any]) -> st.SearchStrategy[GrpcCase]:
    return st.one_of(
        st.builds(lambda b: GrpcCase(method, None, b), st.binary(max_size=512)),
        st.builds(lambda m, cut, pos, byte, tail: GrpcCase(method, None, mutate(
            m.SerializeToString(), cut, pos, byte, tail)), msgs, st.integers(0, 1 << 16),
            st.integers(0, 1 << 16), st.integers(0, 255), st.binary(max_size=16)))


grpc_cases = st.one_of(
    st.builds(lambda r: GrpcCase(JOIN, r), join_requests()),
    st.builds(as_signer, join_requests(), st.integers(0, len(FUZZ_KEYS) - 1)),
    st.builds(lambda r: GrpcCase(DOWNLOAD_STATE, r), state_requests),
    st.builds(lambda r: GrpcCase(DOWNLOAD_STATE, r), state_requests),
    raw_case(JOIN, join_requests()),
    raw_case(DOWNLOAD_STATE, state_requests.map(state_request)),
    st.builds(lambda b: GrpcCase(HEALTH_CHECK, None, b), st.binary(max_size=64)),
    st.builds(lambda m, b: GrpcCase(m, None, b), st.sampled_from(
        ["/moshpit.Averager/Nope", "/moshpit.Averager/join", "/x/y"]), st.binary(max_size=32)),
)
# what a failed call may end with; UNKNOWN is an exception escaping a handler, UNAVAILABLE a
# server that stopped answering
GRPC_OK_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}


def assert_grpc_status(exc: grpc.RpcError) -> None:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNKNOWN and (
            grpc_decode_error(details) or any(sig in details for sig in KNOWN_BUGS)):
        return
    assert code in GRPC_OK_CODES, (code, details)


class Lure:
    """A trainer on daemon 0 that keeps matchmaking under LURE_KEY, so fuzzed Joins reach a
    real leader: accepted fuzz peers become group members with broken endpoints."""

    def __init__(self, socket_path: str) -> None:
        self.client = moshpit.Client(socket_path)
        self.stop = threading.Event()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.average([torch.ones(4)], key=LURE_KEY, group_size=2, timeout=0.5)
                self.outcomes["ok"] += 1
            except moshpit.MoshpitError as exc:
                self.outcomes[type(exc).__name__] += 1
                if isinstance(exc, moshpit.DaemonUnavailable):
                    return

    def __enter__(self) -> Lure:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.client.close()


def run_grpc_case(channel: grpc.Channel, case: GrpcCase, state_version: int,
                  leader: bytes = b"") -> str:
    """Send one request, read at most two responses; returns what came back. `leader`: the
    peer id signed joins are meant for."""
    request: pb.JoinRequest | pb.StateRequest | None = None
    if isinstance(case.request, dict):
        request = state_request(case.request, state_version)
    elif case.request is not None:
        request = case.request
        if case.signer is not None:  # a fresh signature (and nonce) each time it runs
            request = PeerAuth(FUZZ_KEYS[case.signer]).sign_join(pb.JoinRequest(
                **{f.name: getattr(case.request, f.name) for f in
                   pb.JoinRequest.DESCRIPTOR.fields}), leader)
    body = case.raw if request is None else request.SerializeToString()
    if case.method == HEALTH_CHECK:
        call_unary = channel.unary_unary(case.method, request_serializer=None,
                                         response_deserializer=None)
        try:
            call_unary(body, timeout=2.0)
        except grpc.RpcError as exc:
            assert_grpc_status(exc)
            return f"health {exc.code().name}"
        return "health ok"
    parse: Callable[[bytes], Any] = (pb.JoinResponse.FromString if case.method == JOIN
                                     else pb.StateChunk.FromString)
    stream = channel.unary_stream(case.method, request_serializer=None,
                                  response_deserializer=None)
    call = stream(body, timeout=2.0)
    outcome = [case.method.rsplit("/", 1)[1]]
    try:
        for i, raw in enumerate(call):
            reply = parse(raw)
            if isinstance(reply, pb.JoinResponse):
                outcome.append(pb.JoinCode.Name(reply.code))
            else:
                outcome.append("chunk")
            if isinstance(request, pb.StateRequest):
                assert isinstance(reply, pb.StateChunk)
                assert reply.version == state_version and len(reply.data) <= 1 << 20, reply
                if request.length:
                    assert reply.offset >= request.offset, (request, reply.offset)
            if i >= 1:
                break
    except grpc.RpcError as exc:
        assert_grpc_status(exc)
        outcome.append(exc.code().name)
    finally:
        call.cancel()
    return " ".join(outcome)


def test_fuzz_grpc(target: Target) -> None:
    state_version = target.state_version
    leader = bytes.fromhex(target.daemon.info["peer_id"])
    with grpc.insecure_channel(target.daemon.info["grpc"]) as channel, \
            Lure(target.daemon.socket) as lure:
        @FUZZ
        @given(case=grpc_cases)
        def fuzz(case: GrpcCase) -> None:
            outcome = run_grpc_case(channel, case, state_version, leader)
            target.stats[f"grpc {outcome}"] += 1
            target.after_case()

        fuzz()
    for name, n in lure.outcomes.items():
        target.stats[f"lure {name}"] += n
    target.check("after gRPC fuzzing")


def test_download_state_refusals(target: Target) -> None:
    """A DownloadState the daemon cannot serve ends with NOT_FOUND (no such key) or
    FAILED_PRECONDITION (another version), and costs no traceback in its log."""
    target.check_logs()
    with grpc.insecure_channel(target.daemon.info["grpc"]) as channel:
        download = channel.unary_stream(DOWNLOAD_STATE,
                                        request_serializer=pb.StateRequest.SerializeToString,
                                        response_deserializer=pb.StateChunk.FromString)
        for request, code in [(pb.StateRequest(key="no-such-run"), grpc.StatusCode.NOT_FOUND),
                              (pb.StateRequest(key=STATE_KEY, version=1),
                               grpc.StatusCode.FAILED_PRECONDITION)]:
            with pytest.raises(grpc.RpcError) as err:
                list(download(request, timeout=5))
            assert err.value.code() == code, err.value.details()
    for d in target.swarm.daemons:
        with open(d.log_path, errors="replace") as f:
            f.seek(target.log_pos.get(d.name, 0))
            assert "Traceback" not in f.read()

