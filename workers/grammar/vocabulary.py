"""The vocabulary xgrammar compiles grammars against, made from a kvray tokenizer. The
controller (compiling) and rank 0 (matching) both make it with this one function from the same
tokenizer, and xgrammar refuses a compiled grammar whose vocabulary metadata differs, so the two
cannot silently disagree on what a token id spells."""

from __future__ import annotations

from collections.abc import Sequence

from workers.tokenizer import ByteTokenizer, HFTokenizer


class NoGrammarVocabularyError(ValueError):
    """The model's tokenizer cannot be described to xgrammar (a checkpoint without one)."""


def grammar_vocabulary(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """An ``xgrammar.TokenizerInfo`` covering the model's ``vocab_size`` logits (ids past the
    tokenizer's own vocabulary spell nothing and are never allowed); the grammar ends with
    one of ``stop_token_ids``."""
    import xgrammar

    if not stop_token_ids:
        raise NoGrammarVocabularyError(
            "structured outputs need the model's end-of-sequence token, and this model names "
            "none (eos_token_id)"
        )
    stops = sorted(set(stop_token_ids))
    if isinstance(tokenizer, ByteTokenizer):
        # Token i < 256 is byte i; the specials spell nothing.
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
        vocab = [""] * vocab_size
        for text, index in backend.get_vocab(with_added_tokens=True).items():
            if index < vocab_size:
                vocab[index] = text
        vocab_type, add_prefix_space = _encoding_of(backend.to_str())
        return xgrammar.TokenizerInfo(
            vocab,
            vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=stops,
            add_prefix_space=add_prefix_space,
        )
    reason = getattr(tokenizer, "reason", "this model has no tokenizer")
    raise NoGrammarVocabularyError(f"structured outputs need the model's tokenizer: {reason}")


def _encoding_of(tokenizer_json: str):
    """How token strings spell bytes (GPT-2 byte-level, SentencePiece byte fallback, or as
    they are) and whether the tokenizer prepends a space: xgrammar's own reading of a
    ``tokenizer.json`` (what its ``from_huggingface`` uses, so a kvray tokenizer is described
    as transformers' would be)."""
    import xgrammar

    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    return metadata["vocab_type"], metadata["add_prefix_space"]
