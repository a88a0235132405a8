"""common.grpc_server: the standard health service of every Sluice server answers ``Watch`` (what gRPC's
client-side health checking calls) through the error-mapping interceptor, so a gateway channel follows a
service's SERVING / NOT_SERVING."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import bind, new_server
from gateway.targets import channel_options, grpc_target


def test_health_watch_streams_the_status_and_a_gateway_channel_follows_it() -> None:
    async def scenario() -> None:
        server, health = new_server("sluice.v1.Generation", max_receive_bytes=1 << 20)
        port = bind(server, "127.0.0.1", 0)
        await health.set_serving(False)   # as every server starts: serving once its backend is
        await server.start()
        addr = f"127.0.0.1:{port}"
        watcher = grpc.aio.insecure_channel(addr)
        gateway = grpc.aio.insecure_channel(grpc_target([addr]), options=channel_options())
        try:
            watch = health_pb2_grpc.HealthStub(watcher).Watch(health_pb2.HealthCheckRequest(service=""))
            seen = [(await watch.read()).status]
            assert gateway.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY
            await health.set_serving(True)
            seen.append((await watch.read()).status)
            await asyncio.wait_for(gateway.channel_ready(), 5)   # READY only once the service serves
            await health.set_serving(False)
            seen.append((await watch.read()).status)
            state = gateway.get_state()
            while state is grpc.ChannelConnectivity.READY:
                await asyncio.wait_for(gateway.wait_for_state_change(state), 5)
                state = gateway.get_state()
            assert state is grpc.ChannelConnectivity.TRANSIENT_FAILURE
            watch.cancel()
            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert seen == [not_serving, serving, not_serving]
        finally:
            await watcher.close()
            await gateway.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 20))
