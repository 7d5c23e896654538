"""The control plane's interface (transport/control.py) over its gRPC implementation, on
loopback: handlers see the caller, stream answers that end in None, and refuse with a
ControlError whose kind reaches the caller; a call cancelled on our side is `cancelled` to
its reader; a peer nobody serves is `unavailable`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport import control
from moshpitd.transport.control import Caller, ControlError
from moshpitd.transport.grpc_server import AveragerServer, ChannelPool


def test_answers_end_in_none_and_refusals_keep_their_kind() -> None:
    callers: list[Caller] = []

    async def join(request: pb.JoinRequest, caller: Caller) -> AsyncIterator[pb.JoinResponse]:
        callers.append(caller)
        yield pb.JoinResponse(code=pb.ACCEPTED)
        if request.group_key == "hold":  # answers nothing more until the caller hangs up
            await asyncio.Event().wait()
        yield pb.JoinResponse(code=pb.DISBANDED, message=request.group_key)

    async def state(request: pb.StateRequest, caller: Caller) -> AsyncIterator[pb.StateChunk]:
        if request.version == 0:
            raise ControlError(control.FAILED_PRECONDITION, "another version")
        if request.key != "here":
            raise ControlError(control.NOT_FOUND, f"nothing under {request.key!r}")
        for offset in (0, 3):
            yield pb.StateChunk(offset=offset, data=b"abc")

    async def main() -> None:
        server = AveragerServer(join, state, limits=None)
        port = await server.start("127.0.0.1", 0)
        pool = ChannelPool()
        endpoint = f"127.0.0.1:{port}"
        try:
            call = pool.join(endpoint, pb.JoinRequest(group_key="k"), timeout=5)
            first, second = await call.read(), await call.read()
            assert first is not None and first.code == pb.ACCEPTED
            assert second is not None and (second.code, second.message) == (pb.DISBANDED, "k")
            assert await call.read() is None  # the handler ended the call
            assert callers and callers[0].address and callers[0].certificate == b""

            # our side cancels a call another task is reading: that reader hears a
            # ControlError, not a CancelledError that would end its own task
            held = pool.join(endpoint, pb.JoinRequest(group_key="hold"), timeout=5)
            assert (await held.read()) is not None
            reading = asyncio.ensure_future(held.read())
            await asyncio.sleep(0)  # the reader is in read() now, waiting for an answer
            assert not reading.done()
            held.cancel()
            try:
                await reading
                raise AssertionError("a cancelled call answered")
            except ControlError as exc:
                assert exc.kind == control.CANCELLED, exc

            chunks = pool.download(endpoint, pb.StateRequest(key="here", version=1), timeout=5)
            assert [c.offset async for c in chunks] == [0, 3]
            for request, kind in ((pb.StateRequest(key="gone", version=1), control.NOT_FOUND),
                                  (pb.StateRequest(key="here"), control.FAILED_PRECONDITION)):
                refused = pool.download(endpoint, request, timeout=5)
                try:
                    await refused.read()
                    raise AssertionError("the refusal did not reach the caller")
                except ControlError as exc:
                    assert exc.kind == kind, exc
        finally:
            await pool.close()
            await server.stop(0)
        # nobody listens there any more
        pool = ChannelPool()
        try:
            call = pool.join(endpoint, pb.JoinRequest(group_key="k"), timeout=5)
            try:
                await call.read()
                raise AssertionError("a call to a closed port answered")
            except ControlError as exc:
                assert exc.kind == control.UNAVAILABLE, exc
        finally:
            await pool.close()

    asyncio.run(main())
