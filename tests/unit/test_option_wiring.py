"""The timing options reach what they bound: a node built from the config hands
dht_rpc_timeout to the DHT protocol, and matchmaking_attempt_timeout to every round's clock and
to the data plane's wait for streams of unknown groups."""

from __future__ import annotations

import asyncio

from moshpitd.config import load
from moshpitd.matchmaking.liveness import Liveness
from moshpitd.node import MoshpitNode
from moshpitd.node_config import NodeConfig
from moshpitd.runner import Endpoints, RoundRunner


def build(config: NodeConfig) -> tuple[MoshpitNode, RoundRunner]:
    node = MoshpitNode(config)

    async def probe(endpoint: str, peer_id: bytes) -> bool:
        return True

    runner = RoundRunner(config, Endpoints(b"\x01" * 20, "127.0.0.1:1", "127.0.0.1:2"),
                         node.dht, node.pool, node.registry, node.hooks, node.metrics, node.log,
                         Liveness(probe), lambda: False)
    return node, runner


def test_node_hands_the_options_to_the_dht_the_clock_and_the_data_plane() -> None:
    settings = load({"dht_rpc_timeout": "0.3", "matchmaking_attempt_timeout": "2.5"}, {}, None)

    async def main() -> None:
        node, runner = build(NodeConfig.of(settings, ""))
        protocol = node.dht._create_protocol()
        assert protocol._wait_timeout == 0.3  # what rpcudp waits for each answer
        clock = runner.clock(100.0)
        assert clock.attempt(clock.start) == 2.5
        short = runner.clock(1.0)
        assert short.attempt(short.start) == 1.0  # still within the request's timeout
        assert node.registry.stream_wait == 2 * 2.5
        await node.pool.close()

    asyncio.run(main())


def test_defaults_are_the_values_used_before_they_were_options() -> None:
    async def main() -> None:
        node, runner = build(NodeConfig())
        assert node.dht._create_protocol()._wait_timeout == 1.0
        clock = runner.clock(100.0)
        assert clock.attempt(clock.start) == 5.0
        await node.pool.close()

    asyncio.run(main())


def test_the_protocol_gives_up_on_a_silent_peer_after_the_option_not_rpcudps_5_s() -> None:
    async def main() -> float:
        settings = load({"dht_rpc_timeout": "0.2"}, {}, None)
        node, _ = build(NodeConfig.of(settings, ""))
        loop = asyncio.get_running_loop()
        silent, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol,
                                                        local_addr=("127.0.0.1", 0))
        host, port = silent.get_extra_info("sockname")[:2]
        await node.dht.start("127.0.0.1", 0)
        try:
            start = loop.time()
            answered, _ = await node.dht.protocol.ping((host, port), node.dht.node.id)
            assert answered is False
            return loop.time() - start
        finally:
            node.dht.stop()
            silent.close()
            await node.pool.close()

    waited = asyncio.run(main())
    assert 0.2 <= waited < 2.5, waited
