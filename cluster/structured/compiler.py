"""Compiling a request's structured outputs into the grammar rank 0 samples with: xgrammar,
against the model's vocabulary, in a worker thread (a large schema takes a while; the event
loop keeps serving), cached by the constraint (the same schema is compiled once).

Why xgrammar: on SmolLM2's 49k-token vocabulary it compiled the test schema in 6 ms and filled
a token mask in 15 us, where llguidance took 3 ms and 143 us per mask (both on this machine's
CPU, through their Python APIs); it serializes a compiled grammar (sent to the sampling rank)
and its matchers roll back. It is also vLLM's and SGLang's default.

JSON is compact, as ``json.dumps`` writes it (", " and ": ", no other whitespace): a small
model let loose on "any whitespace" can spend its whole budget on newlines. A schema becomes
xgrammar's EBNF, then one repair: xgrammar (0.2.9) writes the characters of a string with
``minLength``/``maxLength`` as anything but quote, backslash and line breaks, so other control
characters would come out raw, which is not JSON; they are excluded. (Writing the bounds as a
``pattern`` instead would work too, but a regex repeated 100000 times compiles for seconds and
fills masks ever slower.)
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict

from cluster.structured.schema_check import check_schema
from cluster.validation import InvalidRequestError
from workers.grammar.vocabulary import NoGrammarVocabularyError, grammar_vocabulary
from workers.request_limits import MAX_SCHEMA_NESTING, RequestFieldError, check_nested_text
from workers.structured_outputs import FIELD, StructuredOutputs

CACHE_SIZE = 512  # compiled grammars kept (each some tens of KiB for a 50k vocabulary)
OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's messages start with "[time] file.cc:line: " and may say "Check failed: ...: ".
_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: .*? is false: ")


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiler = None  # made at first use: describing the vocabulary takes ~0.1 s
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, bytes] = OrderedDict()
        self.num_compiled = 0  # compilations, not cache hits (tests read it)

    async def compile(self, spec: StructuredOutputs) -> bytes:
        """The serialized compiled grammar of ``spec``; InvalidRequestError when it does not
        compile, saying why."""
        key = spec.key
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        compiled = await asyncio.to_thread(self.compile_now, spec)
        self._cache[key] = compiled
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def compile_now(self, spec: StructuredOutputs) -> bytes:
        kind = spec.kind
        param = f"{FIELD}.{kind}"
        if kind == "json":
            try:
                schema = json.loads(spec.json)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"The JSON schema is not JSON: {exc}", param=param
                ) from None
            try:  # every string text UTF-8 can encode, nesting bounded (as in messages)
                check_nested_text(schema, param, limit=MAX_SCHEMA_NESTING)
            except RequestFieldError as exc:
                raise InvalidRequestError.of(exc) from None
            check_schema(schema, param)
        compiler = self._xgrammar_compiler()
        try:
            compiled = _compile(compiler, spec)
        except RuntimeError as exc:
            raise InvalidRequestError(
                f"The {DESCRIPTIONS[kind]} does not compile: {_reason(exc)}", param=param
            ) from None
        self.num_compiled += 1
        return compiled.serialize_json().encode()

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                try:
                    vocabulary = grammar_vocabulary(
                        self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids
                    )
                except NoGrammarVocabularyError as exc:
                    raise InvalidRequestError(str(exc), param=FIELD) from None
                self._compiler = xgrammar.GrammarCompiler(vocabulary, max_threads=2)
            return self._compiler


DESCRIPTIONS = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "grammar",
}


def _compile(compiler, spec: StructuredOutputs):
    kind = spec.kind
    if kind == "json":
        return compiler.compile_grammar(json_grammar(spec.json))
    if kind == "json_object":  # any object: extra properties are the point
        return compiler.compile_grammar(json_grammar(OBJECT_SCHEMA, strict=False))
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec.choice))
    return compiler.compile_grammar(spec.grammar)


# xgrammar's character class for a length-bounded string, and the one JSON allows there.
_BOUNDED_STRING_CHARACTER = r"(([^\"\\\r\n]))"
_JSON_STRING_CHARACTER = r"(([^\0-\x1f\"\\]))"


def json_grammar(schema: str, strict: bool = True) -> str:
    """The EBNF of a JSON schema (compact JSON), bounded strings repaired (see above)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(grammar).replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are the
    grammar's: quotes, backslashes and control characters; other text as it is)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _reason(exc: Exception) -> str:
    lines = [_NOISE.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__
