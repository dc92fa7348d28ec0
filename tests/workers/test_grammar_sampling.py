"""Grammar-constrained sampling on the sampling rank: the bitmask's layout and application,
the sampler with constrained and free rows in one batch, and the matchers' bookkeeping across
preemption, rollback and termination. Real xgrammar grammars over the byte vocabulary."""

from __future__ import annotations

import asyncio

import pytest
import torch
import xgrammar

from cluster.structured.compiler import GrammarCompiler
from workers.grammar.bitmask import allowed_tokens, apply_token_bitmask, bitmask_width
from workers.grammar.matchers import GrammarMatchers
from workers.grammar.vocabulary import grammar_vocabulary
from workers.sampler import Sampler, SamplingRow
from workers.sampling import SamplingParams
from workers.structured_outputs import StructuredOutputs
from workers.tokenizer import ByteTokenizer

VOCAB = 258
EOS = ByteTokenizer.EOS


def compiled(**spec) -> tuple[StructuredOutputs, bytes]:
    structured = StructuredOutputs(**spec)
    return structured, asyncio.run(GrammarCompiler(ByteTokenizer(), VOCAB).compile(structured))


def vocabulary():
    return grammar_vocabulary(ByteTokenizer(), VOCAB, (EOS,))


def constrained_sampler() -> Sampler:
    return Sampler("cpu", (EOS,), GrammarMatchers(vocabulary))


@pytest.mark.parametrize("vocab_size", [31, 32, 33, 258, 1000])
def test_bitmask_layout_is_xgrammars(vocab_size):
    """Our device-agnostic expansion masks exactly what xgrammar's own kernel masks, for
    random bitmasks (sign bit included) and vocabularies that do not fill the last word."""
    generator = torch.Generator().manual_seed(vocab_size)
    width = bitmask_width(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, width), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    ours = apply_token_bitmask(logits, torch.arange(3), bitmask)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])
    assert allowed_tokens(bitmask, vocab_size).shape == (3, vocab_size)


def test_only_listed_rows_are_masked():
    logits = torch.randn(4, 64)
    nothing_allowed = torch.zeros((2, bitmask_width(64)), dtype=torch.int32)
    masked = apply_token_bitmask(logits, torch.tensor([1, 3]), nothing_allowed)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isinf(masked[[1, 3]]).all()
    assert not torch.isinf(logits).any()  # a new tensor: the model's logits stay


def test_constrained_token_is_the_only_one_drawn():
    """Logits that favour every other token by far still give the grammar's token."""
    spec, grammar = compiled(choice=("x",))
    sampler = constrained_sampler()
    params = SamplingParams(temperature=1.0, structured_outputs=spec)
    sampler.add_request("r", params, grammar)
    logits = torch.full((1, VOCAB), 50.0)
    logits[0, ord("x")] = -50.0
    sampled = sampler.sample_rows(logits, [SamplingRow("r", params, [1], [])])
    assert sampled.tokens.tolist() == [ord("x")] and sampled.refused == []
    sampled = sampler.sample_rows(logits, [SamplingRow("r", params, [1], [ord("x")])])
    assert sampled.tokens.tolist() == [EOS]  # the grammar is complete: only EOS is left


def test_mixed_batch_free_rows_sample_as_without_neighbours():
    """Constrained and free rows in one step: the free rows' tokens (greedy and seeded) are
    those a sampler with no constrained rows gives; constrained rows obey their grammars."""
    digits, digits_grammar = compiled(regex="[0-9]+")
    yes_no, yes_no_grammar = compiled(choice=("yes", "no"))
    free_greedy = SamplingParams(temperature=0.0)
    free_seeded = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3

    alone = Sampler("cpu", (EOS,))
    alone.add_request("g", free_greedy)
    alone.add_request("s", free_seeded)
    free_rows = [SamplingRow("g", free_greedy, [1], []), SamplingRow("s", free_seeded, [1], [])]
    expected = alone.sample_rows(logits[[0, 2]], free_rows).tokens.tolist()

    to_digits = SamplingParams(temperature=1.0, structured_outputs=digits)
    to_yes_no = SamplingParams(temperature=0.0, structured_outputs=yes_no)
    mixed = constrained_sampler()
    mixed.add_request("g", free_greedy)
    mixed.add_request("d", to_digits, digits_grammar)
    mixed.add_request("s", free_seeded)
    mixed.add_request("y", to_yes_no, yes_no_grammar)
    rows = [
        free_rows[0],
        SamplingRow("d", to_digits, [1], []),
        free_rows[1],
        SamplingRow("y", to_yes_no, [1], []),
    ]
    tokens = mixed.sample_rows(logits, rows).tokens.tolist()
    assert [tokens[0], tokens[2]] == expected
    assert chr(tokens[1]).isdigit()
    assert chr(tokens[3]) in "yn"


def test_matcher_follows_the_requests_tokens():
    """A matcher made late takes in the outputs the request already has (a resumed request);
    fewer outputs than it took in roll it back; a terminated grammar leaves its row free."""
    _, grammar = compiled(regex="ab|ac")
    matchers = GrammarMatchers(vocabulary)
    matchers.add("r", grammar)
    indices, bitmask = matchers.masks([("r", [ord("a")])])  # resumed after "a"
    assert indices == [0]
    allowed = allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist()
    assert allowed == [ord("b"), ord("c")]
    assert matchers.accept(["r"], [ord("b")]) == []
    # The request lost its last token (a discarded sample): the matcher rolls back with it.
    indices, bitmask = matchers.masks([("r", [ord("a")])])
    assert allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist() == [ord("b"), ord("c")]
    matchers.accept(["r"], [ord("c")])
    indices, bitmask = matchers.masks([("r", [ord("a"), ord("c")])])
    assert allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist() == [EOS]
    matchers.accept(["r"], [EOS])
    # Terminated: a step sent before the controller saw the EOS samples this row freely.
    assert matchers.masks([("r", [ord("a"), ord("c"), EOS])]) is None


def test_refused_token_is_reported_not_raised():
    _, grammar = compiled(choice=("x",))
    matchers = GrammarMatchers(vocabulary)
    matchers.add("r", grammar)
    matchers.masks([("r", [])])
    assert matchers.accept(["r"], [ord("y")]) == ["r"]
    assert matchers.masks([("r", [ord("y")])]) is None  # failed: no longer constrained


def test_min_tokens_yields_to_a_finished_grammar():
    """Below min_tokens EOS is held back, unless the grammar allows nothing else."""
    spec, grammar = compiled(choice=("x",))
    sampler = constrained_sampler()
    params = SamplingParams(temperature=0.0, min_tokens=5, structured_outputs=spec)
    sampler.add_request("r", params, grammar)
    logits = torch.zeros((1, VOCAB))
    sampled = sampler.sample_rows(logits, [SamplingRow("r", params, [1], [ord("x")])])
    assert sampled.tokens.tolist() == [EOS] and sampled.refused == []


def test_removed_request_forgets_its_matcher():
    _, grammar = compiled(regex="a+")
    sampler = constrained_sampler()
    sampler.add_request("r", SamplingParams(), grammar)
    assert "r" in sampler.grammars
    sampler.remove_request("r")
    assert len(sampler.grammars) == 0


def test_sampler_without_grammar_support_refuses_a_constrained_request():
    _, grammar = compiled(regex="a+")
    with pytest.raises(ValueError, match="no grammar support"):
        Sampler("cpu", (EOS,)).add_request("r", SamplingParams(), grammar)


def test_masks_filled_ahead_are_the_ones_used():
    """The runner fills masks while the device runs the forward; sampling with them advances
    the matcher once, as sampling without them does."""
    spec, grammar = compiled(regex="ab")
    sampler = constrained_sampler()
    params = SamplingParams(temperature=1.0, structured_outputs=spec)
    sampler.add_request("r", params, grammar)
    logits = torch.zeros((1, VOCAB))
    rows = [SamplingRow("r", params, [1], [])]
    masks = sampler.fill_masks(rows)
    assert sampler.sample_rows(logits, rows, masks).tokens.tolist() == [ord("a")]
    rows = [SamplingRow("r", params, [1], [ord("a")])]
    assert sampler.sample_rows(logits, rows).tokens.tolist() == [ord("b")]
    assert sampler.fill_masks([SamplingRow("free", SamplingParams(), [1], [])]) is None
