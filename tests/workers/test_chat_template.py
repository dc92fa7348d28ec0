"""Chat templates render exactly as transformers' ``apply_chat_template(..., tokenize=False)``."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from workers.chat_template import ChatTemplateError, reads_content_parts, render_chat

# SmolLM2's: ChatML with a default system prompt.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3.2's shape: bos_token, whitespace control, strftime_now, trim.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

# Mistral 7B Instruct v0.1's: roles must alternate.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

# Qwen2.5's shape: tools and tool calls through tojson, text parts, reasoning, namespace, loop
# controls, a {% generation %} block.
TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n" + (tools[0] | tojson(indent=2, sort_keys=true)) + "<|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(num_tool_turns=0) %}
{%- for message in messages %}
    {%- if message.role == "tool" %}
        {%- set ns.num_tool_turns = ns.num_tool_turns + 1 %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- elif message.content is defined %}
        {%- for part in message.content if part.type == 'text' %}{{ part.text }}{% endfor %}
    {%- endif %}
    {%- if message.role == "assistant" %}
        {%- if message.reasoning_content %}
            {{- '<think>' + message.reasoning_content + '</think>' }}
        {%- endif %}
        {% generation %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {{- '\\n<tool_call>\\n' + tool_call.function | tojson(separators=(',', ':')) }}
            {%- if loop.index >= 2 %}{% break %}{% endif %}
        {%- endfor %}
        {% endgeneration %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{{- 'tool turns: ' ~ ns.num_tool_turns ~ '\\n' }}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

SPECIAL_TOKENS = {
    "chatml": dict(bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"),
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "mistral": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    "tools": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "tools": TOOLS}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Et en français ? «quatre» 🙂"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Sure.", "reasoning": "call the tool"},
        {"role": "user", "content": "Thanks\n"},
    ],
]
TOOL_CONVERSATION = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "time", "arguments": {"tz": "<CET>"}}},
            {"type": "function", "function": {"name": "never", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]
TOOLS_SPEC = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo d'une ville, <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def hf_tokenizer(name: str):
    """A transformers tokenizer carrying the template: a tiny WordLevel model is enough, since
    rendering with ``tokenize=False`` never tokenizes."""
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS[name]
    vocab = {token: i for i, token in enumerate(["[UNK]", *special.values()])}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), **special
    )
    tokenizer.chat_template = TEMPLATES[name]
    return tokenizer


def expected(name: str, messages, add_generation_prompt: bool, **extra) -> str:
    return hf_tokenizer(name).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", ["chatml", "llama3", "tools"])
def test_templates_render_as_transformers_does(name, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = render_chat(
            TEMPLATES[name],
            messages,
            special_tokens=SPECIAL_TOKENS[name],
            add_generation_prompt=add_generation_prompt,
        )
        assert ours == expected(name, messages, add_generation_prompt)


PARTS = [{"type": "text", "text": "Two lines:"}, {"type": "text", "text": "  the second "}]


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral", "tools"])
def test_text_parts_render_as_transformers_renders_them(name):
    """A template that loops over a message's content gets the parts as they are; any other
    gets their texts joined by newlines, as a string."""
    messages = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "ok"}]
    ours = render_chat(TEMPLATES[name], messages, special_tokens=SPECIAL_TOKENS[name])
    if reads_content_parts(TEMPLATES[name]):
        reference = messages
    else:
        joined = "\n".join(part["text"] for part in PARTS)
        reference = [{"role": "user", "content": joined}, messages[1]]
    assert ours == expected(name, reference, True)
    assert [reads_content_parts(TEMPLATES[n]) for n in TEMPLATES] == [False, False, False, True]


def test_content_parts_are_found_through_variables_and_filters():
    through_variable = (
        "{% for m in messages %}{% set parts = m['content'] %}"
        "{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}"
    )
    through_filter = (
        "{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}"
        "{{ p.text }}{% endfor %}{% endfor %}"
    )
    assert reads_content_parts(through_variable) and reads_content_parts(through_filter)
    assert not reads_content_parts("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render_chat(through_variable, [{"role": "u", "content": PARTS}], special_tokens={}) == (
        "Two lines:  the second "
    )


def test_tool_calls_and_tojson_render_as_transformers_does():
    for extra in ({}, {"tools": TOOLS_SPEC}):
        ours = render_chat(
            TOOLS, TOOL_CONVERSATION, special_tokens=SPECIAL_TOKENS["tools"], **extra
        )
        assert ours == expected("tools", TOOL_CONVERSATION, True, **extra)
    assert "Zürich" in ours and "Météo" in ours and "<b>now</b> & later" in ours  # not escaped


def test_template_variables_come_from_extra_and_override_special_tokens():
    messages = CONVERSATIONS[0]
    ours = render_chat(
        LLAMA3, messages, special_tokens=SPECIAL_TOKENS["llama3"], date_string="1 Jan 2030"
    )
    assert ours == expected("llama3", messages, True, date_string="1 Jan 2030")
    assert "Today Date: 1 Jan 2030" in ours
    ours = render_chat(MISTRAL, messages, special_tokens={"bos_token": "<s>"}, bos_token="<B>")
    assert ours == "<B>[INST] Hello! [/INST]"


def test_mistral_renders_alternating_roles_and_refuses_others():
    messages = CONVERSATIONS[1][1:]
    for add_generation_prompt in (True, False):
        ours = render_chat(
            MISTRAL,
            messages,
            special_tokens=SPECIAL_TOKENS["mistral"],
            add_generation_prompt=add_generation_prompt,
        )
        assert ours == expected("mistral", messages, add_generation_prompt)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render_chat(MISTRAL, CONVERSATIONS[1], special_tokens=SPECIAL_TOKENS["mistral"])


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "non-empty list"),
        ([["user", "hi"]], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r'messages\[0\] needs a string "role"'),
        ([{"role": 1, "content": "hi"}], r'needs a string "role"'),
        ([{"role": "user"}], r'messages\[0\] "content" must be a string'),
        ([{"role": "user", "content": 3}], "or a list of"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "parts"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": ["a"]}], r"messages\[1\]"),
    ],
)
def test_malformed_messages_are_refused_clearly(messages, problem):
    with pytest.raises(ChatTemplateError, match=problem):
        render_chat(CHATML, messages, special_tokens={})


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{{ messages.__class__.__mro__ }}", "refused"),  # the sandbox
        ("{% set ns = namespace(_x=1) %}", "underscore"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ raise_exception('no system prompt here') }}", "no system prompt here"),
    ],
)
def test_failing_templates_raise_a_value_error(template, problem):
    with pytest.raises(ValueError, match=problem):
        render_chat(template, CONVERSATIONS[0], special_tokens={})
