"""``kvray make-checkpoint deepseek``: the checkpoint has DeepSeek-V3's attention in miniature, its
parameter count is what that geometry implies, and kvray and transformers load the same files
to the same greedy tokens."""

from __future__ import annotations

from cluster.cli import main
from tests.cluster.test_cli import generate_token_ids
from tests.workers.hf_models import reference_generations
from workers.model_source import model_config_for


def test_make_deepseek_writes_a_checkpoint_both_engines_load(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "ckpt"
    args = ["make-checkpoint", "deepseek", str(directory), "--layers", "2", "--q-lora-rank", "0"]
    assert main(args) == 0
    config = model_config_for(str(directory))
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert config.layer_types == ("mla_attention", "mla_attention")
    mla = config.mla
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_rope_head_dim) == (128, None, 32)
    assert (mla.qk_nope_head_dim, mla.v_head_dim, config.vocab_size) == (64, 64, 258)
    hf_model = AutoModelForCausalLM.from_pretrained(directory)
    assert hf_model.config.pad_token_id is None  # no token id reads as padding
    # A layer: q_proj 512 x 8 (64 + 32), kv_a 512 x (128 + 32) and its 128 norm, kv_b 128 x
    # 8 (64 + 64), o_proj 512 x 512, the MLP's 3 x 512 x 1280, two 512 norms; then the last
    # norm, the embeddings and the head (258 x 512 each).
    layer = 512 * 768 + 512 * 160 + 128 + 128 * 1024 + 512 * 512 + 3 * 512 * 1280 + 2 * 512
    expected = 2 * layer + 512 + 2 * 258 * 512
    assert sum(p.numel() for p in hf_model.parameters()) == expected == 5_935_872
    prompt = list(b"Hello, w")
    (reference,) = reference_generations(directory, [prompt], 4)
    assert generate_token_ids(directory, prompt, 4)["token_ids"] == reference
    assert main(["make-checkpoint", "deepseek", str(directory)]) == 2
    assert f"error: {directory} is not empty" in capsys.readouterr().err
