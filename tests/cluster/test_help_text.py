"""``--help`` opens with a whole description: ``kvray``'s, and each benchmark script's (its
docstring's first paragraph, however many lines it wraps to), never a sentence cut at a line."""

from __future__ import annotations

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


@pytest.mark.parametrize("module_name", sorted(SCRIPTS))
def test_a_scripts_help_gives_its_docstrings_whole_first_paragraph(module_name, capsys):
    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as exit_info:
        getattr(module, SCRIPTS[module_name])(["--help"])
    assert exit_info.value.code == 0
    first_paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
    assert described(capsys.readouterr().out) == first_paragraph
    assert first_paragraph.endswith(".")
