"""Tokenizers: a checkpoint's ``tokenizer.json`` or a GGUF's tokenizer metadata through the
``tokenizers`` package, the byte-level tokenizer of the embedded default model, and none at all
for a checkpoint that ships no tokenizer. ``workers.model_source.load_tokenizer_for`` picks
one for a ``--model``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    # An upper bound on the characters of text one token stands for, so a prompt can be
    # refused as too long before it is tokenized.
    max_chars_per_token: int
    # The checkpoint's Jinja chat template, None when it has none.
    chat_template: str | None
    # The text of bos_token, eos_token, unk_token, pad_token, where the checkpoint names them.
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` leaves out what the
        tokenizer's post-processor adds (a BOS), for text that spells its own (chats)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from a ``tokenizer.json`` or built from a GGUF)."""

    def __init__(
        self,
        tokenizer,
        eos_token_ids: tuple[int, ...] = (),
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(token) for token in vocab), default=1)
        # Token strings spell bytes or characters one for one; normalizers may drop some input
        # characters (control characters, combining marks), hence the slack.
        self.max_chars_per_token = 4 * longest

    @classmethod
    def from_directory(cls, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()):
        """``tokenizer.json``, with the chat template and special tokens of
        ``tokenizer_config.json`` (the template may also sit in ``chat_template.jinja`` or
        ``chat_template.json``, as newer checkpoints keep it)."""
        from tokenizers import Tokenizer as _Tokenizer

        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        return cls(
            _Tokenizer.from_file(str(model_dir / "tokenizer.json")),
            eos_token_ids,
            chat_template=_chat_template(model_dir, config),
            special_tokens=special_tokens,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        """The tokenizer a GGUF's ``tokenizer.ggml.*`` metadata spells."""
        from workers.gguf import build_tokenizer

        parts = build_tokenizer(Path(path))
        return cls(
            parts.tokenizer,
            eos_token_ids,
            chat_template=parts.chat_template,
            special_tokens=parts.special_tokens,
        )

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` itself (its vocabulary and decoder)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken
    dict with its text under "content"."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ByteTokenizer:
    """Token ``i < 256`` is byte ``i``; two special tokens follow. Decoding replaces invalid
    UTF-8 (a random model's bytes rarely form valid text) rather than failing."""

    BOS = 256
    EOS = 257
    vocab_size = 258
    max_chars_per_token = 1  # a character is at least one byte
    chat_template = None  # an untrained model: no conversation format

    def __init__(self) -> None:
        self.eos_token_ids = (self.EOS,)
        self.special_tokens: dict[str, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class NoTokenizer:
    """The tokenizer of a checkpoint that ships none (no ``tokenizer.json``).

    Such a model is still served, rather than refused at startup: prompts come as token ids,
    and completions carry token ids with empty text (``decode`` returns ""), so a client that
    tokenizes for itself loses nothing. A text prompt is refused by ``encode`` with a message
    saying to send token ids.
    """

    chat_template = None
    max_chars_per_token = 1 << 20  # text is refused by encode, whatever its length

    def __init__(self, eos_token_ids: tuple[int, ...] = (), reason: str | None = None):
        self.eos_token_ids = eos_token_ids
        self.special_tokens: dict[str, str] = {}
        self.reason = reason or "this model has no tokenizer.json"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"{self.reason}; send prompts as token ids")

    def decode(self, token_ids: list[int]) -> str:
        return ""
