"""``kvray generate``: one completion, streamed as text or printed as JSON with token ids,
against a running server or an engine started for it."""

from __future__ import annotations

import json
import sys

from cluster.cli.flags import add_in_process_flag, add_server_address, add_setting_flags
from cluster.cli.session import client_for


def add_parser(commands, common) -> None:
    generate = commands.add_parser(
        "generate", parents=[common], help="generate once, against a server or locally"
    )
    add_server_address(generate, what="default: start a local engine")
    add_in_process_flag(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate at most (default 16, or fewer when the prompt leaves less room)",
    )
    # Unset sampling fields take the server's defaults (the model's generation_config.json).
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=None, help="a stop string (repeat)")
    generate.add_argument("--ignore-eos", action="store_true")
    constraint = generate.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", help="the output must match this JSON schema (JSON text, or @FILE)"
    )
    constraint.add_argument("--json-object", action="store_true", help="output any JSON object")
    constraint.add_argument("--regex", help="the output must match this regular expression")
    constraint.add_argument(
        "--choice", action="append", default=None, help="the output is one of these (repeat)"
    )
    constraint.add_argument("--grammar", help="the output must match this EBNF grammar (or @FILE)")
    generate.add_argument(
        "--output",
        choices=["text", "json"],
        default="text",
        help="text streams the completion; json prints it with token ids",
    )
    add_setting_flags(generate)


def run(args) -> int:
    prompt, sampling = _prompt(args), _sampling(args)
    with client_for(args) as client:
        if args.output == "json":
            completion = client.generate(prompt, **sampling)
            record = {
                "request_id": completion.request_id,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "usage": vars(completion.usage),
            }
            print(json.dumps(record))
            return 0
        for delta in client.stream(prompt, **sampling):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _sampling(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        structured_outputs=_constraint(args),
    )


def _constraint(args) -> dict | None:
    """The --json-schema / --json-object / --regex / --choice / --grammar given, if any."""
    if args.json_object:
        return {"json_object": True}
    if args.choice:
        return {"choice": args.choice}
    for kind, value in (("json", args.json_schema), ("regex", args.regex),
                        ("grammar", args.grammar)):  # fmt: skip
        if value is not None:
            return {kind: _text_or_file(value)}
    return None


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    with open(value[1:], encoding="utf-8") as file:
        return file.read()


def _prompt(args):
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
    except ValueError:
        raise ValueError("--prompt-token-ids takes comma-separated integers, e.g. 1,2,3") from None
