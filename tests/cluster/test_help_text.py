"""``--help`` opens with a whole description: ``kvray``'s, each subcommand's (the line its
parent lists it by, as a sentence) and each benchmark script's (its docstring's first
paragraph, however many lines it wraps to), never a sentence cut at a line."""

from __future__ import annotations

import argparse
import importlib

import pytest

from cluster.cli import build_parser

# module -> the function that parses its command line
SCRIPTS = {
    "cluster.bench.engine_parity": "main",
    "cluster.bench.gpu_check": "main",
    "cluster.bench.kernel_accuracy": "main",
    "cluster.bench.mla_mamba_accuracy": "main",
    "cluster.bench.mla_prefill": "parse_args",
    "cluster.bench.moe_layer": "main",
    "cluster.bench.structured": "main",
    "kernels.attention.bench": "main",
    "kvcore.bench_coordinator": "main",
}


def described(help_text: str) -> str:
    """The description paragraph of an argparse help text, its lines joined."""
    paragraphs = help_text.split("\n\n")
    return " ".join(paragraphs[1].split())


def test_kvrays_help_describes_it_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    description = described(capsys.readouterr().out)
    assert description.startswith("LLM inference on Ray")
    assert description.endswith("`kvray COMMAND --help` tells each command's flags.")


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every subcommand's words, ``("bench", "decode")`` and the like."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subcommand in action.choices.items():
                yield (*path, name)
                yield from command_paths(subcommand, (*path, name))


def test_every_subcommands_help_opens_with_what_it_does(capsys):
    parser = build_parser()
    paths = list(command_paths(parser))
    assert ("serve",) in paths and ("bench", "decode") in paths
    descriptions = {}
    for path in paths:
        with pytest.raises(SystemExit):
            parser.parse_args([*path, "--help"])
        descriptions[path] = described(capsys.readouterr().out)
    for path, description in descriptions.items():
        assert description[0].isupper() and description.endswith("."), (path, description)
        assert not description.startswith(("options:", "positional arguments:")), path
    assert descriptions[("serve",)] == "Serve a model over gRPC and HTTP on Ray."
    assert descriptions[("bench", "decode")] == (
        "The time of one decode step at each context length (one in-process worker)."
    )


@pytest.mark.parametrize("module_name", sorted(SCRIPTS))
def test_a_scripts_help_gives_its_docstrings_whole_first_paragraph(module_name, capsys):
    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as exit_info:
        getattr(module, SCRIPTS[module_name])(["--help"])
    assert exit_info.value.code == 0
    first_paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
    assert described(capsys.readouterr().out) == first_paragraph
    assert first_paragraph.endswith(".")
