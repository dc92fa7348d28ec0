"""Tokenizers: a checkpoint's tokenizer.json with its chat template and special tokens, a
checkpoint without one (token ids only), and the default model's byte tokenizer. (A GGUF's
tokenizer is tested in test_gguf.py.)"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from cluster.client import Client, KVRayError
from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from workers.model_source import load_tokenizer_for
from workers.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer

NO_TOKENIZER_MESSAGE = "this model has no tokenizer.json; send prompts as token ids"


def save_word_tokenizer(directory) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3, "ray": 4, "<s>": 5, "</s>": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_tokenizer_json_is_loaded_with_the_tokenizers_package(tmp_path):
    save_word_tokenizer(tmp_path)
    loaded = load_tokenizer_for(str(tmp_path), eos_token_ids=(4,))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("hello kv world nope") == [1, 3, 2, 0]
    assert loaded.decode([1, 2]) == "hello world"
    assert loaded.eos_token_ids == (4,)
    assert loaded.chat_template is None and loaded.special_tokens == {}


def test_chat_template_and_special_tokens_come_from_tokenizer_config(tmp_path):
    save_word_tokenizer(tmp_path)
    config = {
        "chat_template": "{{ messages[0]['content'] }}",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "special": True},
        "unk_token": "[UNK]",
        "pad_token": None,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer_for(str(tmp_path))
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert loaded.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]"}

    # Newer checkpoints keep the template beside the config; the .jinja file wins.
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_tokenizer_for(str(tmp_path)).chat_template == "from json"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert load_tokenizer_for(str(tmp_path)).chat_template == "from jinja"


def test_named_chat_templates_use_the_default_one(tmp_path):
    save_word_tokenizer(tmp_path)
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert load_tokenizer_for(str(tmp_path)).chat_template == "chat"


def test_missing_tokenizer_json_gives_a_token_id_only_tokenizer(tmp_path):
    tokenizer = load_tokenizer_for(str(tmp_path), eos_token_ids=(2,))
    assert isinstance(tokenizer, NoTokenizer)
    with pytest.raises(ValueError) as info:
        tokenizer.encode("hello")
    assert str(info.value) == NO_TOKENIZER_MESSAGE
    assert tokenizer.decode([5, 6, 7]) == ""
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.chat_template is None and tokenizer.special_tokens == {}
    assert tokenizer.max_chars_per_token >= 1


def test_checkpoint_without_tokenizer_serves_token_id_prompts(tmp_path):
    model_dir = save_model("llama", tmp_path)
    assert not (model_dir / "tokenizer.json").exists()
    expected = reference_generations(model_dir, [PROMPTS[1]], 6)[0]
    config = EngineConfig(
        model=str(model_dir), kv_cache_memory_bytes=8 << 20, port=0, max_model_len=256
    )
    with LocalServer(config) as server, Client(server.address) as client:
        completion = client.generate(PROMPTS[1], max_tokens=6, temperature=0.0, ignore_eos=True)
        assert completion.token_ids == expected
        assert completion.text == ""
        with pytest.raises(KVRayError, match="send prompts as token ids"):
            client.generate("hello", max_tokens=2)


def test_byte_tokenizer_round_trips_and_tolerates_invalid_utf8():
    tokenizer = load_tokenizer_for(None)
    assert isinstance(tokenizer, ByteTokenizer)
    assert isinstance(load_tokenizer_for("embedded:20m"), ByteTokenizer)
    ids = tokenizer.encode("héllo")
    assert ids == list("héllo".encode())
    assert tokenizer.decode(ids) == "héllo"
    assert tokenizer.decode([0xFF, ByteTokenizer.EOS, 65]) == "\ufffdA"
    assert tokenizer.eos_token_ids == (ByteTokenizer.EOS,)
    assert tokenizer.chat_template is None and tokenizer.special_tokens == {}
