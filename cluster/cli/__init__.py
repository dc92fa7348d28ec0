"""The ``kvray`` command: ``serve``, ``generate``, ``chat``, ``batch``, ``bench``, ``plan`` and
``make-checkpoint``, one module each (its parser and what it does).

Flags follow vLLM's names where the two overlap; every flag that sets an engine setting is
made from ``EngineConfig``'s fields (``cluster.cli.flags``), and those with a ``KVRAY_*``
variable take their default from it (see ``cluster.env``).
"""

from __future__ import annotations

import argparse
import logging

from cluster.cli import batch, bench, chat, checkpoints, generate, plan, serve
from cluster.cli.errors import report
from cluster.cli.flags import add_log_level, engine_config

COMMANDS = {
    "serve": serve,
    "generate": generate,
    "chat": chat,
    "batch": batch,
    "bench": bench,
    "plan": plan,
    "make-checkpoint": checkpoints,
}

__all__ = ["build_parser", "engine_config", "main"]
DESCRIPTION = (
    "LLM inference on Ray: serve a model over gRPC and the OpenAI HTTP API, generate, chat, "
    "run a batch, benchmark, plan the KV cache or write a test checkpoint. "
    "`kvray COMMAND --help` tells each command's flags."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvray", description=DESCRIPTION)
    common = argparse.ArgumentParser(add_help=False)
    add_log_level(common)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(commands, common)
    describe_subcommands(parser)
    return parser


def describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's ``--help`` opens with the line its parent lists it by, as a sentence
    (unless it was given a description of its own), at every level (``kvray bench decode``)."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for listed in action._choices_actions:
            subcommand = action.choices[listed.dest]
            if subcommand.description is None and listed.help:
                subcommand.description = listed.help[0].upper() + listed.help[1:] + "."
            describe_subcommands(subcommand)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one readable line, not a traceback (see cluster.cli.errors)
        return report(args.command, exc)
