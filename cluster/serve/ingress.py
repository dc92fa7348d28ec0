"""The ingress deployment: the OpenAI HTTP API, served through Serve's HTTP proxy (this class
is its ASGI app), and the gRPC API, served by this replica itself on ``--port`` (a thin
ingress: the same servicer, tolerant parsing, API-key check and health service as one
engine's), both over the engine replicas (``ReplicaSet``)."""

from __future__ import annotations

from cluster.api.v1 import kvray_pb2 as pb
from cluster.assembly import served_model_name
from cluster.config import EngineConfig
from cluster.http.app import build_app
from cluster.serve.info import replica_set_info
from cluster.serve.replica_set import ReplicaSet
from cluster.server import ApiServer
from kvcore import decode
from workers.model_source import model_config_for


class Ingress:
    async def __init__(self, replicas, config_bytes: bytes):
        self.config = config = decode(config_bytes, EngineConfig)
        self.replica_set = ReplicaSet(replicas, config, model_config_for(config.model))
        await replicas.ready.remote()  # the router starts: the replicas' stats flow from now
        self.grpc = ApiServer(
            self.replica_set,
            self.describe,
            host=config.host,
            port=config.port,
            api_key=config.api_key,
            max_request_bytes=config.max_request_body_bytes,
        )
        await self.grpc.start()
        self.asgi_app = build_app(
            self.replica_set,
            model_name=served_model_name(config),
            api_key=config.api_key,
            max_model_len=self.replica_set.max_model_len,
            max_request_bytes=config.max_request_body_bytes,
            tool_call_parser=config.tool_call_parser,
        )

    def __serve_build_asgi_app__(self):
        return self.asgi_app

    def describe(self) -> pb.ServerInfo:
        return replica_set_info(self.config, self.replica_set.vocab_size)

    async def grpc_address(self) -> str:
        return self.grpc.address

    async def info(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(self.describe(), preserving_proto_field_name=True)

    async def drain(self, timeout: float) -> int:
        """Health turns NOT_SERVING and new requests are refused; running ones may finish for
        ``timeout`` seconds. Returns how many were aborted at the deadline."""
        await self.grpc.set_serving(False)
        return await self.replica_set.drain(timeout)

    async def __del__(self) -> None:
        await self.grpc.stop(0.5)
