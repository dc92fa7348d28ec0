"""``kvray make-checkpoint hybrid`` and ``kvray bench decode``: the checkpoint loads in kvray and
transformers alike, and the decode mode prints a row per context length, timed over steps
that decode the whole batch (these are not timing tests). Run in this process: each command
is a few seconds of work, and a fresh interpreter would cost as much again."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench.decode_cost import max_new_tokens
from cluster.bench.workload import parse_lengths
from cluster.cli import main
from cluster.config import EngineConfig
from workers.default_model import default_checkpoint
from workers.model_source import DEFAULT_CONFIG

SMALL = ["--kv-cache-memory", "16MiB", "--log-level", "WARNING"]
# A Mamba layer's state is 530 KB; prefix caching keeps up to 16 of them a step per group.
HYBRID_SMALL = ["--kv-cache-memory", "64MiB", "--log-level", "WARNING"]


def run_bench(capsys, tmp_path, *args: str) -> dict:
    output = tmp_path / f"{args[0]}.json"
    assert main(["bench", *args, "--output-json", str(output)]) == 0
    table = capsys.readouterr().out.splitlines()
    report = json.loads(output.read_text())
    assert table[0] == f"kvray bench {args[0]}"
    assert len(table) == 2 + len(report["results"])  # title, header, a line per row
    return report


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid") / "ckpt"
    assert main(["make-checkpoint", "hybrid", str(directory), "--pattern", "M*-M"]) == 0
    return directory


def test_make_hybrid_writes_a_checkpoint_both_engines_load(hybrid_dir, capsys):
    from transformers import AutoModelForCausalLM

    from workers.model_source import model_config_for

    config = model_config_for(str(hybrid_dir))
    assert config.architecture == "NemotronHForCausalLM"
    assert config.layer_types == ("mamba", "full_attention", "mlp", "mamba")
    assert config.vocab_size == 258 and config.max_position_embeddings == 8192
    hf_model = AutoModelForCausalLM.from_pretrained(hybrid_dir)
    assert hf_model.config.pad_token_id is None  # no token id reads as padding
    # Mamba: in_proj 512 x (1024 z + 1536 xBC + 16 dt), conv 1536 x 4 + bias, dt_bias, A, D,
    # gated norm 1024, out_proj 1024 x 512; attention: q, o 512 x 512, k, v 256 x 512; MLP
    # 2 x 512 x 1280; a 512 norm before each layer and one last; embeddings and head 258 x 512.
    mamba = 512 * 2576 + 1536 * 5 + 3 * 16 + 1024 + 1024 * 512
    attention = 2 * 512 * 512 + 2 * 256 * 512
    expected = 2 * mamba + attention + 2 * 512 * 1280 + 5 * 512 + 2 * 258 * 512
    assert sum(p.numel() for p in hf_model.parameters()) == expected == 6_067_808
    assert main(["make-checkpoint", "hybrid", str(hybrid_dir)]) == 2
    assert f"error: {hybrid_dir} is not empty" in capsys.readouterr().err


def test_decode_rows_per_context_length(capsys, tmp_path):
    report = run_bench(
        capsys,
        tmp_path,
        "decode",
        "--context-lens",
        "16,48",
        "--batch-size",
        "3",
        "--output-len",
        "4",
        "--warmup-steps",
        "1",
        "--max-num-batched-tokens",
        "64",
        *SMALL,
    )
    short, long = report["results"]
    num_params = sum(t.numel() for t in default_checkpoint(DEFAULT_CONFIG).values())
    for row, context_len in ((short, 16), (long, 48)):
        assert row["model"] == "embedded:tiny"
        assert row["params_m"] == pytest.approx(num_params / 1e6)
        assert row["context_len"] == context_len and row["batch_size"] == 3
        assert row["decode_steps"] == 4
        # A request decodes while later ones prefill (48 x 3 tokens over steps of 64): the
        # timed steps start past the prompt by those outputs and the warm-up step.
        assert context_len + 2 <= row["mean_context_len"] <= context_len + 12
        assert 0 < row["forward_ms_median"] <= row["step_ms_median"] <= row["step_ms_p90"]
        assert row["output_tokens_per_s"] == pytest.approx(3000 / row["step_ms_median"])
    assert short["step_vs_first"] == 1.0
    assert long["step_vs_first"] == pytest.approx(long["step_ms_median"] / short["step_ms_median"])


def test_decode_and_throughput_on_the_hybrid(hybrid_dir, capsys, tmp_path):
    model = ["--model", str(hybrid_dir)]
    report = run_bench(
        capsys,
        tmp_path,
        "decode",
        *model,
        "--context-lens",
        "40,8",
        "--batch-size",
        "2",
        "--output-len",
        "3",
        "--warmup-steps",
        "0",
        *HYBRID_SMALL,
    )
    assert [r["context_len"] for r in report["results"]] == [40, 8]
    assert all(r["decode_steps"] == 3 for r in report["results"])
    assert report["results"][0]["params_m"] == pytest.approx(6.067808)
    report = run_bench(
        capsys,
        tmp_path,
        "throughput",
        *model,
        "--in-process",
        "--num-prompts",
        "3",
        "--input-len",
        "8-16",
        "--output-len",
        "2-4",
        "--hf-batch-size",
        "2",
        "--compare",
        "transformers",
        "--max-model-len",
        "64",
        *HYBRID_SMALL,
    )
    kvray, hf = report["results"]
    assert kvray["engine"] == "kvray (in-process, TP 1)" and kvray["requests"] == 3
    assert hf["engine"] == "transformers (cpu, sorted batches of 2)" and hf["requests"] == 3
    assert hf["output_tokens_per_s"] > 0


def test_decode_lengths_and_refusals(capsys):
    args = argparse.Namespace(batch_size=8, warmup_steps=4, output_len=32)
    # 8 x 4096 prompt tokens take at most 17 steps of 2048 less 8 decodes; a request may
    # decode in each of them before the 4 warm-up and 32 timed steps.
    assert max_new_tokens(EngineConfig(), args, 4096) == 17 + 4 + 32 + 1
    assert parse_lengths("256,4096") == [256, 4096]
    with pytest.raises(ValueError, match="lengths"):
        parse_lengths("0,5")
    too_short = ["--max-model-len", "100", "--context-lens", "90", "--batch-size", "2"]
    assert main(["bench", "decode", *too_short, *SMALL]) == 2
    error = capsys.readouterr().err  # 90 + one prefill step + 4 warm-up + 32 timed + 1
    assert "--max-model-len 100 is too short" in error and "need 128 tokens" in error
    assert main(["bench", "decode", "--batch-size", "2", "--max-num-seqs", "1", *SMALL]) == 2
    assert "--batch-size 2 is over --max-num-seqs" in capsys.readouterr().err
    assert main(["make-checkpoint", "hybrid", "unused", "--pattern", "M*E"]) == 2
    assert "'M*E': one letter a layer, each of M, *, -" in capsys.readouterr().err
