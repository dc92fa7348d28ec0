"""A client for a command that generates: of ``--server``, or of an engine started for the
command and stopped after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cluster.cli.flags import engine_config
from cluster.client import Client
from cluster.launch import running_engine


@contextmanager
def client_for(args) -> Iterator[Client]:
    if args.server is not None:
        with Client(args.server, api_key=args.api_key) as client:
            yield client
        return
    with (
        running_engine(engine_config(args), in_process=args.in_process) as address,
        Client(address) as client,
    ):
        yield client
