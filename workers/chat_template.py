"""Chat templates: a checkpoint's Jinja template turned into prompt text, as transformers'
``apply_chat_template(..., tokenize=False)`` renders it.

Templates come from the Hub and are untrusted code, so they run in Jinja's immutable sandbox,
with the same globals, filters and extensions transformers gives them (templates are written
against transformers, so any difference shows up as a wrong prompt).

A message's content may be a string or OpenAI's list of text parts. A template that iterates
over a message's content gets the parts as they are; any other template expects a string, so
the parts' texts reach it joined by newlines (as vLLM joins them), and it renders what
transformers renders for that string.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; transformers copies it to the first two, which
# templates read (Qwen3 reads ``reasoning_content``, gpt-oss ``thinking``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template does not compile, raised an error, or the messages are malformed."""


def render_chat(
    template: str,
    messages: list[dict],
    *,
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """``messages`` rendered by ``template``. ``special_tokens`` (``bos_token``...) and
    ``extra`` (``tools``, ``documents``, ``enable_thinking``...) become template variables;
    ``extra`` wins over a special token of the same name, as in transformers."""
    chat = _checked_messages(messages)
    compiled = _compile(template)
    if not reads_content_parts(template):
        chat = [_joined_parts(message) for message in chat]
    variables = {"tools": None, "documents": None, **special_tokens, **extra}
    variables |= {"messages": chat, "add_generation_prompt": add_generation_prompt}
    try:
        return compiled.render(**variables)
    except jinja2.TemplateError as error:  # raise_exception, sandbox refusals, undefined names
        raise ChatTemplateError(f"The chat template refused these messages: {error}") from None
    except Exception as error:  # e.g. a template adding a string to a list
        raise ChatTemplateError(
            f"The chat template failed on these messages: {type(error).__name__}: {error}"
        ) from None


def _checked_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` as transformers hands them to the template (keys set to None
    dropped, reasoning aliased), after checking their shape."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of messages")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be an object, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f'messages[{index}] needs a string "role"')
        _check_content(index, message)
        reasoning = next((message[f] for f in _REASONING_FIELDS if f in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _check_content(index: int, message: dict) -> None:
    content = message.get("content")
    if content is None and "tool_calls" in message:
        return  # an assistant turn that only calls tools
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return
    raise ChatTemplateError(
        f'messages[{index}] "content" must be a string or a list of '
        f'{{"type": "text", "text": ...}} parts, got {content!r}'
    )


def _joined_parts(message: dict) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


@lru_cache(maxsize=16)
def reads_content_parts(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``{% for part in
    message['content'] %}``, directly or through a variable set from it), which is how a
    template that takes OpenAI's list of parts reads them."""
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateError:
        return False  # rendering will say why it does not compile
    content_names = {
        target.name
        for assign in tree.find_all(jinja2.nodes.Assign)
        if _reads_content(assign.node)
        for target in _assigned_names(assign.target)
    }
    return any(
        _reads_content(loop.iter)
        or any(name.name in content_names for name in _names_in(loop.iter))
        for loop in tree.find_all(jinja2.nodes.For)
    )


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether ``node`` is or contains ``x.content`` or ``x['content']``."""
    candidates = [node, *node.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))]
    for candidate in candidates:
        if isinstance(candidate, jinja2.nodes.Getattr) and candidate.attr == "content":
            return True
        if (
            isinstance(candidate, jinja2.nodes.Getitem)
            and isinstance(candidate.arg, jinja2.nodes.Const)
            and candidate.arg.value == "content"
        ):
            return True
    return False


def _names_in(node: jinja2.nodes.Node) -> list[jinja2.nodes.Name]:
    return [node] if isinstance(node, jinja2.nodes.Name) else list(node.find_all(jinja2.nodes.Name))


def _assigned_names(target: jinja2.nodes.Node) -> list[jinja2.nodes.Name]:
    return [name for name in _names_in(target) if name.ctx == "store"]


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"The chat template does not compile: {error}") from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # Older releases have known sandbox escapes, and templates are untrusted.
        raise ImportError(f"Chat templates need jinja2>=3.1.6, found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, ') and takes no separators;
    # templates expect plain JSON, non-ASCII kept, as transformers renders it.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without handing the template the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, which could reach Python internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so ``namespace(self=1)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore names on a namespace, got {name!r}"
        )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    rendering needs only the body."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's Extension API)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()
