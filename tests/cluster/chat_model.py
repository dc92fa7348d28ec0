"""A tiny random-weight Llama with a real byte-level BPE tokenizer and a ChatML chat template,
saved as a Hugging Face directory: a chat model in every way but its (random) answers."""

from __future__ import annotations

import json
from pathlib import Path

from tests.workers.hf_models import save_model

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_chat_model(directory: Path) -> Path:
    """The llama test model (vocabulary 300) with 256 byte tokens and three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    save_model("llama", directory)
    alphabet = ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)  # ids 256, 257, 258
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "unk_token": None,
            }
        )
    )
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = 258  # <|im_end|>
    (directory / "config.json").write_text(json.dumps(config))
    return directory
