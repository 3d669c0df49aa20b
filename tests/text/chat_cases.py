"""Templates and conversations whose transformers renderings are kept in ``data/chat-template-goldens.json``.

``data/make_chat_goldens.py`` renders them with ``transformers.utils.chat_template_utils.render_jinja_template``
(transformers 5.23.0); ``test_chat_template.py`` checks that ``ChatTemplate.render`` gives the same strings.
Each template exercises one rule of transformers' environment.
"""

from __future__ import annotations

from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo du jour <b>&</b> 天気",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Ville, e.g. 'Zürich'"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}},
]

TEMPLATES: dict[str, str] = {
    # tools rendered with tojson, a namespace that finds the last user turn, tool calls and responses
    "tools": (
        "{%- if tools %}\n"
        "    {{- '<|im_start|>system\\n' }}\n"
        "    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
        "    {{- '# Tools\\n<tools>' }}\n"
        "    {%- for tool in tools %}\n"
        "        {{- '\\n' }}{{- tool | tojson }}\n"
        "    {%- endfor %}\n"
        "    {{- '\\n</tools><|im_end|>\\n' }}\n"
        "{%- elif messages[0].role == 'system' %}\n"
        "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
        "{%- endif %}\n"
        "{%- set ns = namespace(last_user=-1) %}\n"
        "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}\n"
        "{%- for message in messages %}\n"
        "    {%- if message.role == 'system' %}{% continue %}{% endif %}\n"
        "    {%- if message.role == 'assistant' and message.tool_calls is defined %}\n"
        "        {{- '<|im_start|>assistant\\n' }}{% if message.content %}{{ message.content }}{% endif %}\n"
        "        {%- for call in message.tool_calls %}\n"
        '            {{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}\n'
        "            {{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}\n"
        "        {%- endfor %}\n"
        "        {{- '<|im_end|>\\n' }}\n"
        "    {%- elif message.role == 'tool' %}\n"
        "        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}\n"
        "        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
        "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}\n"
        "    {%- else %}\n"
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content }}\n"
        "        {%- if loop.index0 == ns.last_user %}{{ ' [last user]' }}{% endif %}\n"
        "        {{- '<|im_end|>\\n' }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
    ),
    # tojson's keyword arguments and its treatment of non-ASCII and HTML characters
    "tojson": (
        "{{ messages | tojson }}\n"
        "{{ messages[0] | tojson(indent=2) }}\n"
        "{{ {'b': 1, 'a': [1, 2.5, none, true]} | tojson(sort_keys=true, separators=(',', ':')) }}\n"
        "{{ messages[0].content | tojson(ensure_ascii=true) }}\n"
    ),
    # {% break %} / {% continue %}, loop variables, trim_blocks and lstrip_blocks on indented blocks
    "loops": (
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message.role == 'stop' %}\n"
        "        {% break %}\n"
        "    {% endif %}\n"
        "    {% if message.role == 'skip' %}{% continue %}{% endif %}\n"
        "    [{{ loop.index }}/{{ loop.length }}{% if loop.first %} first{% endif %}] "
        "{{ message.role }}: {{ message.content }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "    assistant:\n"
        "{% endif %}\n"
        "{{ eos_token }}"
    ),
    # raise_exception, as templates use it to refuse a conversation
    "strict_roles": (
        "{% for message in messages %}"
        "{% if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}"
        "{{ '[' + message.role + '] ' + message.content | trim + '\\n' }}"
        "{% endfor %}"
    ),
    # filters and string methods templates lean on
    "filters": (
        "{% set sys = messages | selectattr('role', 'equalto', 'system') | list %}"
        "{{ sys | length }};{{ (messages | map(attribute='role') | join(',')) | upper }};"
        "{{ messages[-1].content.split(' ')[0] }};{{ messages[-1].content.startswith('na') }};"
        "{{ messages[-1].content[:5] | replace('a', 'A') }};{{ '%s-%d' | format('x', 3) }};"
        "{{ messages | rejectattr('role', 'equalto', 'system') | map(attribute='content') | map('length') | sum }};"
        "{{ (messages[0].get('name') or 'anon') }};{{ messages[0].items() | list | length }}"
    ),
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": 'naïve café 日本語 🎉 "q" <b>&\'</b>'},
        {"role": "assistant", "content": "  ok  "},
        {"role": "user", "content": "naan bread please"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": "12 °C"},
        {"role": "tool", "content": "cloudy"},
        {"role": "user", "content": "thanks"},
    ],
    "controls": [
        {"role": "user", "content": "one"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "two"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "after stop"},
    ],
}

#: ``(template, conversation, tools, add_generation_prompt)``; the cases the goldens hold.
CASES: list[tuple[str, str, bool, bool]] = [
    ("tools", "plain", True, True),
    ("tools", "plain", False, False),
    ("tools", "tool_calls", True, True),
    ("tojson", "plain", False, False),
    ("tojson", "tool_calls", False, True),
    ("loops", "controls", False, True),
    ("loops", "plain", False, False),
    ("strict_roles", "tool_calls", False, False),  # raises: a tool turn where a user turn should be
    ("strict_roles", "controls", False, False),  # raises too
    ("filters", "plain", False, False),
]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"


def case_id(case: tuple[str, str, bool, bool]) -> str:
    template, conversation, tools, generation = case
    return f"{template}-{conversation}{'-tools' if tools else ''}{'-gen' if generation else ''}"
