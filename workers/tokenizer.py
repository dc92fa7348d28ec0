"""Tokenizers: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` package, or the
byte-level tokenizer of the embedded default model."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    # An upper bound on the characters of text one token stands for, so a prompt can be
    # refused as too long before it is tokenized.
    max_chars_per_token: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class HFTokenizer:
    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))
        self.eos_token_ids = eos_token_ids
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(token) for token in vocab), default=1)
        # Token strings spell bytes or characters one for one; normalizers may drop some input
        # characters (control characters, combining marks), hence the slack.
        self.max_chars_per_token = 4 * longest

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


class ByteTokenizer:
    """Token ``i < 256`` is byte ``i``; two special tokens follow. Decoding replaces invalid
    UTF-8 (a random model's bytes rarely form valid text) rather than failing."""

    BOS = 256
    EOS = 257
    vocab_size = 258
    max_chars_per_token = 1  # a character is at least one byte

    def __init__(self) -> None:
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path | None, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The checkpoint's tokenizer; the byte tokenizer when there is no model directory."""
    if model_dir is None:
        return ByteTokenizer()
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"No tokenizer.json in {model_dir}; kvray reads tokenizers in the tokenizers "
            "package's JSON format. Pass prompts as token ids, or add the file."
        )
    return HFTokenizer(path, eos_token_ids)
