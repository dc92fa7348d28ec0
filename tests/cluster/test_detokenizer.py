"""Incremental detokenization with real ``tokenizers`` BPE models, built here: the streamed text
is what decoding prompt and output together adds to the prompt's own text."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from cluster.output.detokenizer import CONTEXT_TOKENS, MAX_HELD_TOKENS, IncrementalDetokenizer

CORPUS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Paris is a city; Rome is a city too. What is the capital of Spain?",
    "Tokenizers split text into pieces and join the pieces back into text.",
] * 20


def byte_level_bpe() -> Tokenizer:
    """GPT-2's kind: every byte is a symbol, so a character outside the corpus is split into
    one token per UTF-8 byte."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def sentencepiece_bpe() -> Tokenizer:
    """Llama 2's kind: "▁" marks a word start, the decoder strips the text's first space, and
    characters outside the vocabulary fall back to <0xNN> byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"] |= {"byte_fallback": True, "unk_token": "<unk>"}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


class Served:
    """The tokenizer as kvray's ``HFTokenizer`` serves it: special tokens left out of text."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request):
    build = byte_level_bpe if request.param == "byte_level" else sentencepiece_bpe
    return Served(build())


# (prompt, output): outputs with characters outside the vocabulary (several byte tokens each),
# and prompts whose last CONTEXT_TOKENS start inside a character.
CASES = [
    ("The capital of France is", "Paris, and the capital of Italy is Rome."),
    ("What is the capital of Japan?", "東京 🙂 is, café."),
    ("日本の首都は", "東京です。 The capital!"),
    ("", "Paris 🙂"),
    ("text", "\n\n  Rome  é"),
]


def expected_text(tokenizer: Served, prompt_ids: list[int], output_ids: list[int]) -> str:
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + output_ids)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def stream(detokenizer: IncrementalDetokenizer, output_ids: list[int], chunk: int = 1) -> str:
    deltas = [detokenizer.add(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    return "".join(deltas) + detokenizer.flush()


@pytest.mark.parametrize(("prompt", "output"), CASES)
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_streamed_text_is_the_outputs_text_after_its_prompt(tokenizer, prompt, output, chunk):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(output)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    text = stream(detokenizer, output_ids, chunk)
    assert text == expected_text(tokenizer, prompt_ids, output_ids)
    assert detokenizer.text == text


def test_the_first_word_keeps_the_space_its_prompt_gives_it():
    """SentencePiece's "▁Paris" opening a text decodes to "Paris"; after the prompt, " Paris"."""
    tokenizer = Served(sentencepiece_bpe())
    prompt_ids = tokenizer.encode("The capital of France is")
    output_ids = tokenizer.encode("Paris")
    assert tokenizer.decode(output_ids) == "Paris"
    with_context = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids)
    assert with_context == expected_text(tokenizer, prompt_ids, output_ids) == " Paris"
    assert stream(IncrementalDetokenizer(tokenizer), output_ids) == "Paris"  # as it was


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_any_split_of_a_text_into_prompt_and_output_streams_the_outputs_text(tokenizer, chunk):
    """Wherever the prompt ends between characters, inside a run of byte tokens or not (its
    last CONTEXT_TOKENS may then start mid-character), the output's characters come out whole."""
    token_ids = tokenizer.encode("Rome 首都は東京です。🙂🙂 The capital, café!")
    splits = [
        i for i in range(len(token_ids)) if not tokenizer.decode(token_ids[:i]).endswith("\ufffd")
    ]
    assert len(splits) > 15
    for split in splits:
        prompt_ids, output_ids = token_ids[:split], token_ids[split:]
        text = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids, chunk)
        assert text == expected_text(tokenizer, prompt_ids, output_ids), split


def test_an_incomplete_character_is_held_back_until_it_completes(tokenizer):
    prompt_ids = tokenizer.encode("The capital of Japan is")
    output_ids = tokenizer.encode(" 東")
    byte_tokens = output_ids[-3:]  # the three UTF-8 bytes of 東, one token each
    assert [tokenizer.decode([t]) for t in byte_tokens] == ["\ufffd"] * 3
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add([t]) for t in output_ids]
    assert deltas[-3:-1] == ["", ""]
    assert "".join(deltas) == expected_text(tokenizer, prompt_ids, output_ids)
    assert deltas[-1].endswith("東")


def test_only_the_prompts_tail_is_kept_and_each_step_decodes_a_bounded_window(tokenizer):
    windows = []

    class Counting:
        def decode(self, token_ids):
            windows.append(len(token_ids))
            return tokenizer.decode(token_ids)

    prompt_ids = tokenizer.encode(" ".join(CORPUS[:3]))
    detokenizer = IncrementalDetokenizer(Counting(), prompt_ids)
    assert detokenizer.token_ids == prompt_ids[-CONTEXT_TOKENS:]
    byte_token = tokenizer.encode(" 東")[-2]  # a UTF-8 continuation byte, never completing
    text = "".join(detokenizer.add([byte_token]) for _ in range(200))
    assert max(windows) <= CONTEXT_TOKENS + MAX_HELD_TOKENS
    assert len(text) >= 200 - MAX_HELD_TOKENS and set(text) == {"\ufffd"}
