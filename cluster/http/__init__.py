"""The OpenAI-compatible HTTP API: a second front end over the same engine as gRPC."""

from __future__ import annotations


async def start_http_server(config, engine, max_model_len: int, model_name: str):
    """The HTTP API of ``engine`` on ``config.host:config.http_port``, started; None when the
    settings turn it off."""
    if config.http_port is None:
        return None
    from cluster.http.app import build_app
    from cluster.http.server import HttpServer

    app = build_app(
        engine,
        model_name=model_name,
        api_key=config.api_key,
        max_model_len=max_model_len,
        max_request_bytes=config.max_request_body_bytes,
        tool_call_parser=config.tool_call_parser,
    )
    server = HttpServer(app, host=config.host, port=config.http_port)
    await server.start()
    return server
