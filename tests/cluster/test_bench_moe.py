"""``kvray make-checkpoint moe``: a Qwen3-MoE whose every layer routes to experts, with the
parameter count its geometry implies, that kvray and transformers load to the same greedy
tokens; bad expert counts are refused."""

from __future__ import annotations

from cluster.cli import main
from tests.cluster.test_cli import generate_token_ids
from tests.workers.hf_models import reference_generations
from workers.model_source import model_config_for


def test_make_moe_writes_a_checkpoint_both_engines_load(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "ckpt"
    args = ["make-checkpoint", "moe", str(directory), "--layers", "2", "--experts", "4"]
    assert main(args) == 0
    config = model_config_for(str(directory))
    assert config.architecture == "Qwen3MoeForCausalLM" and config.vocab_size == 258
    moe = config.moe
    assert (moe.layers, moe.num_experts, moe.top_k, moe.intermediate_size) == ((0, 1), 4, 2, 192)
    assert moe.norm_topk_prob
    # A layer: q and o 512 x 512, k and v 512 x 256, two 64 Q/K norms, the router 4 x 512,
    # four experts of 3 x 512 x 192, two 512 norms; then the last norm, embeddings and head.
    layer = 2 * 512 * 512 + 2 * 512 * 256 + 2 * 64 + 4 * 512 + 4 * 3 * 512 * 192 + 2 * 512
    expected = 2 * layer + 512 + 2 * 258 * 512
    hf_model = AutoModelForCausalLM.from_pretrained(directory)
    assert sum(p.numel() for p in hf_model.parameters()) == expected
    prompt = list(b"Hello, w")
    (reference,) = reference_generations(directory, [prompt], 4)
    assert generate_token_ids(directory, prompt, 4)["token_ids"] == reference
    bad = ["make-checkpoint", "moe", str(tmp_path / "bad"), "--experts", "2", "--top-k", "3"]
    assert main(bad) == 2
    assert "--top-k must be between 1 and --experts (2), got 3" in capsys.readouterr().err
