"""Tokenizers: a checkpoint's tokenizer.json, and the default model's byte tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from workers.tokenizer import ByteTokenizer, load_tokenizer


def test_tokenizer_json_is_loaded_with_the_tokenizers_package(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3, "ray": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, eos_token_ids=(4,))
    assert loaded.encode("hello kv world nope") == [1, 3, 2, 0]
    assert loaded.decode([1, 2]) == "hello world"
    assert loaded.eos_token_ids == (4,)


def test_missing_tokenizer_json_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer_round_trips_and_tolerates_invalid_utf8():
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    ids = tokenizer.encode("héllo")
    assert ids == list("héllo".encode())
    assert tokenizer.decode(ids) == "héllo"
    assert tokenizer.decode([0xFF, ByteTokenizer.EOS, 65]) == "\ufffdA"
    assert tokenizer.eos_token_ids == (ByteTokenizer.EOS,)
