"""``kvray chat``: one answer to ``--prompt``, or a conversation read turn by turn from stdin
(an empty line or EOF ends it); the answers stream, and the conversation so far goes with each
turn."""

from __future__ import annotations

import sys

from cluster.cli.flags import add_in_process_flag, add_server_address, add_setting_flags
from cluster.cli.session import client_for


def add_parser(commands, common) -> None:
    chat = commands.add_parser(
        "chat",
        parents=[common],
        help="talk to a chat model: one question (--prompt), or a conversation on stdin",
    )
    add_server_address(chat, what="default: start a local engine")
    chat.add_argument("--prompt", default=None, help="one question; without it, read turns")
    chat.add_argument("--system", default=None, help="a system message first")
    chat.add_argument("--max-tokens", type=int, default=256, help="per answer (default 256)")
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    add_in_process_flag(chat)
    add_setting_flags(chat)


def run(args) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    turns = [args.prompt] if args.prompt is not None else _read_turns()
    with client_for(args) as client:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            answer = ""
            for delta in client.stream(messages, **sampling):
                answer += delta.text
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": answer})
    return 0


def _read_turns():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return
        yield line.rstrip("\n")
