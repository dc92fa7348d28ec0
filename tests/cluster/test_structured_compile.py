"""Compiling structured outputs on the controller: what compiles, what is refused and why,
the cache, and the list of schema keywords refused because xgrammar would not enforce them
(probed against xgrammar itself, so the list cannot go stale in silence)."""

from __future__ import annotations

import asyncio
import json

import pytest
import xgrammar

from cluster.structured.compiler import GrammarCompiler
from cluster.structured.schema_check import UNENFORCED, check_schema
from cluster.validation import InvalidRequestError
from workers.grammar.vocabulary import grammar_vocabulary
from workers.request_limits import RequestFieldError
from workers.structured_outputs import StructuredOutputs
from workers.tokenizer import ByteTokenizer, NoTokenizer

VOCAB = 258


def compile_spec(compiler: GrammarCompiler, **spec) -> bytes:
    return asyncio.run(compiler.compile(StructuredOutputs(**spec)))


def matches(grammar: bytes, text: str) -> bool:
    info = grammar_vocabulary(ByteTokenizer(), VOCAB, (ByteTokenizer.EOS,))
    compiled = xgrammar.CompiledGrammar.deserialize_json(grammar.decode(), info)
    matcher = xgrammar.GrammarMatcher(compiled)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.is_completed()


@pytest.fixture()
def compiler():
    return GrammarCompiler(ByteTokenizer(), VOCAB)


def test_each_kind_compiles_to_what_it_says(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = compile_spec(compiler, json=json.dumps(schema))
    assert matches(grammar, '{"n": 12}') and not matches(grammar, '{"n": "x"}')
    assert not matches(grammar, '{"n": 1, "extra": 2}')  # strict: no unlisted properties
    assert not matches(grammar, '{\n"n": 1}')  # compact JSON: no free whitespace
    objects = compile_spec(compiler, json_object=True)
    assert matches(objects, '{"any": [1, {"thing": null}]}') and not matches(objects, "[1]")
    assert matches(compile_spec(compiler, regex=r"\d{3}-[a-z]+"), "123-ab")
    choices = ("yes", 'say "hi"\n', "emoji 😀", "back\\slash")
    grammar = compile_spec(compiler, choice=choices)
    assert all(matches(grammar, choice) for choice in choices)
    assert not matches(grammar, "ye")
    assert matches(compile_spec(compiler, grammar='root ::= "a" ("b" | "c")*'), "abcb")


def test_length_bounded_strings_are_json_strings(compiler):
    """Bounds hold, and a control character cannot appear raw (xgrammar's own rule for
    bounded strings lets one through)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2,
              "maxLength": 4}}, "required": ["s"]}  # fmt: skip
    grammar = compile_spec(compiler, json=json.dumps(schema))
    assert matches(grammar, '{"s": "ab"}') and matches(grammar, '{"s": "abcd"}')
    assert not matches(grammar, '{"s": "a"}') and not matches(grammar, '{"s": "abcde"}')
    assert not matches(grammar, '{"s": "a\x19b"}')
    both = {"type": "string", "pattern": "[a-z]+", "maxLength": 3}
    with pytest.raises(InvalidRequestError, match="beside a pattern"):
        compile_spec(compiler, json=json.dumps(both))


def test_the_same_constraint_compiles_once(compiler):
    first = compile_spec(compiler, regex="a+")
    assert compile_spec(compiler, regex="a+") == first
    compile_spec(compiler, regex="b+")
    assert compiler.num_compiled == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": '{"type": "objekt"}'}, 'Unsupported type "objekt"'),
        ({"json": "{not json"}, "is not JSON"),
        ({"json": "5"}, "must be an object or a boolean"),
        ({"json": '{"$ref": "#/$defs/missing"}'}, "missing"),
        ({"regex": "(unclosed"}, "parenthesis is not closed"),
        ({"grammar": "root ::= undefined_rule"}, 'Rule "undefined_rule" is not defined'),
        ({"json": '{"enum": ["\\ud800"]}'}, "lone surrogate U\\+D800"),
        ({"json": '{"items": ' * 70 + "{}" + "}" * 70}, "nests deeper than 64 levels"),
    ],
)
def test_what_does_not_compile_is_refused_saying_why(compiler, spec, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        compile_spec(compiler, **spec)
    assert caught.value.param.startswith("structured_outputs.")
    assert "/project/" not in str(caught.value)  # xgrammar's source locations are trimmed


@pytest.mark.parametrize(
    "spec",
    [{}, {"regex": "a", "choice": ("a",)}, {"choice": ()}, {"regex": ""}, {"choice": ("a", "")}],
)
def test_malformed_specs_are_refused(spec):
    with pytest.raises(RequestFieldError, match=r"structured_outputs|choice|empty"):
        StructuredOutputs(**spec).check()


def test_a_model_without_tokenizer_cannot_be_constrained():
    compiler = GrammarCompiler(NoTokenizer((1,)), 16)
    with pytest.raises(InvalidRequestError, match="need the model's tokenizer"):
        compile_spec(compiler, regex="a")


# An instance that breaks each refused keyword: xgrammar's grammar still accepts it.
UNENFORCED_PROBES = {
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    "not": ({"not": {"type": "string"}}, '"a"'),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"a"'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "dependentRequired": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED_PROBES))
def test_refused_keywords_are_ones_xgrammar_ignores(keyword):
    """If xgrammar starts enforcing one, this fails: take it off the refused list."""
    schema, breaking = UNENFORCED_PROBES[keyword]
    compiled = xgrammar.GrammarCompiler(
        grammar_vocabulary(ByteTokenizer(), VOCAB, (ByteTokenizer.EOS,))
    ).compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert matches(compiled.serialize_json().encode(), breaking)
    with pytest.raises(InvalidRequestError, match=f"'{keyword}'"):
        check_schema(schema, "response_format")


def test_refused_keywords_are_found_in_subschemas_only_where_schemas_sit():
    nested = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(InvalidRequestError, match="'uniqueItems' at #/properties/xs"):
        check_schema(nested, "p")
    with pytest.raises(InvalidRequestError, match=r"'not' at #/\$defs/d/anyOf/1"):
        check_schema({"$defs": {"d": {"anyOf": [{}, {"not": {}}]}}}, "p")
    # Properties named like keywords are names, not keywords.
    check_schema({"type": "object", "properties": {"not": {}, "allOf": {}, "if": {}}}, "p")
    with pytest.raises(InvalidRequestError, match="only references within the schema"):
        check_schema({"$ref": "https://example.com/schema.json"}, "p")
    assert set(UNENFORCED) >= set(UNENFORCED_PROBES)


def test_a_checkpoints_vocabulary_is_described_as_from_transformers(tmp_path):
    """kvray's tokenizer, described to xgrammar, equals what xgrammar makes of transformers'
    tokenizer for the same checkpoint (so grammars mean the same tokens as in vLLM)."""
    from transformers import AutoTokenizer

    from tests.cluster.chat_model import save_chat_model
    from workers.model_source import load_tokenizer_for, model_config_for

    directory = save_chat_model(tmp_path)
    config = model_config_for(str(directory))
    ours = grammar_vocabulary(
        load_tokenizer_for(str(directory), config.eos_token_ids), config.vocab_size, (258,)
    )
    theirs = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(directory), vocab_size=config.vocab_size, stop_token_ids=[258]
    )
    assert ours.vocab_type == theirs.vocab_type and ours.vocab_size == theirs.vocab_size == 300
    assert ours.add_prefix_space == theirs.add_prefix_space
    assert ours.decoded_vocab == theirs.decoded_vocab
