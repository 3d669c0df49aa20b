"""ChatTemplate: transformers' renderings character for character, its errors, and the sandbox."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chat_cases import BOS_TOKEN, CASES, CONVERSATIONS, EOS_TOKEN, TEMPLATES, TOOLS, case_id
from gguf import GGUFWriter

import aioexperts
from aioexperts import ChatTemplate, ChatTemplateError
from aioexperts._text import chat as chat_module


def _vocab_dir() -> Path:
    """``$AIOEXPERTS_VOCAB``, else ``vocab/`` beside ``$AIOEXPERTS_FIXTURES``, else ``../shared/vocab``."""
    if os.environ.get("AIOEXPERTS_VOCAB"):
        return Path(os.environ["AIOEXPERTS_VOCAB"])
    if os.environ.get("AIOEXPERTS_FIXTURES"):
        return Path(os.environ["AIOEXPERTS_FIXTURES"]).parent / "vocab"
    return Path(__file__).resolve().parents[2].parent / "shared" / "vocab"


VOCAB = _vocab_dir()
if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1" and not VOCAB.is_dir():
    raise RuntimeError(f"the shared vocabularies are required (AIOEXPERTS_REQUIRE_FIXTURES=1) but {VOCAB} is missing")
SHARED_GOLDENS = VOCAB / "chat-goldens.json"
LOCAL_GOLDENS = json.loads((Path(__file__).parent / "data" / "chat-template-goldens.json").read_text())["cases"]


def _shared_cases() -> list[tuple[str, dict[str, object], int]]:
    if not SHARED_GOLDENS.exists():
        return []
    files = json.loads(SHARED_GOLDENS.read_text())
    return [(name, entry, i) for name, entry in files.items() for i in range(len(entry["cases"]))]


@pytest.mark.skipif(not SHARED_GOLDENS.exists(), reason=f"no {SHARED_GOLDENS}")
@pytest.mark.parametrize(
    ("name", "entry", "index"), _shared_cases(), ids=lambda v: str(v) if isinstance(v, int) else None
)
def test_renders_the_shared_goldens(name: str, entry: dict[str, object], index: int) -> None:
    template = ChatTemplate.from_gguf(VOCAB / str(entry["gguf"]))
    assert (template.bos_token, template.eos_token) == (entry["bos_token"], entry["eos_token"])
    case = entry["cases"][index]  # type: ignore[index]
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_renders_what_transformers_renders(case: tuple[str, str, bool, bool]) -> None:
    name, conversation, tools, generation = case
    want = LOCAL_GOLDENS[case_id(case)]
    template = ChatTemplate(TEMPLATES[name], bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
    messages = CONVERSATIONS[conversation]

    def render() -> str:
        return template.render(messages, add_generation_prompt=generation, tools=TOOLS if tools else None)

    if "error" in want:
        with pytest.raises(ChatTemplateError) as info:
            render()
        assert want["error"] in str(info.value)
    else:
        assert render() == want["expected"]


def test_tojson_keeps_non_ascii_and_html_characters() -> None:
    text = "日本 <b>&'\"é"
    out = ChatTemplate("{{ messages[0].content | tojson }}").render([{"role": "user", "content": text}])
    assert out == json.dumps(text, ensure_ascii=False)
    assert "日本" in out and "<b>&'" in out  # jinja2's own tojson gives \u65e5... and \u003c


def test_messages_are_not_changed_by_rendering() -> None:
    messages = [{"role": "user", "content": "hi"}]
    before = json.dumps(messages)
    ChatTemplate("{% set x = messages | list %}{{ x | length }}").render(messages)
    assert json.dumps(messages) == before


def test_strftime_now_gives_the_current_date() -> None:
    out = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert out in {(datetime.date.today() + datetime.timedelta(days=d)).isoformat() for d in (-1, 0)}


def test_raise_exception_carries_the_templates_message() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
    )
    assert template.render([{"role": "user", "content": ""}]) == ""
    with pytest.raises(ChatTemplateError, match="first turn must be user"):
        template.render([{"role": "assistant", "content": ""}])


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("{% for m in messages %}{{ m }}", "endfor"),
        ("{{ messages[0] ", "line 1"),
        ("{% if %}\n", "Expected an expression"),
        ("{% generation %}{{ messages }}", "endgeneration"),  # an unclosed generation block
        ("{% endgeneration %}", "endgeneration"),
    ],
)
def test_a_syntax_error_is_a_chat_template_error(source: str, needle: str) -> None:
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError") as info:
        ChatTemplate(source)
    assert needle in str(info.value)
    assert isinstance(info.value, aioexperts.AioExpertsError) and isinstance(info.value, ValueError)


# a template that marks the assistant's turns for transformers' return_assistant_tokens_mask (SmolLM3, OLMo)
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_generation_block_renders_its_body_as_transformers_does() -> None:
    """transformers' AssistantTracker renders ``{% generation %}``'s body unchanged (it only records where
    the body lies); the template without the tags renders the same text."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    got = ChatTemplate(GENERATION_TEMPLATE).render(messages, add_generation_prompt=True)
    assert got == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert got == ChatTemplate(plain).render(messages, add_generation_prompt=True)
    # the body is a scope of its own (transformers runs it as a call block's caller); loops and
    # namespaces reach into it, trim_blocks applies to its tags
    scoped = (
        "{% set y = 1 %}{% set ns = namespace(v=0) %}{% for m in messages %}{% generation %}"
        "{% set y = 2 %}{% set ns.v = ns.v + 1 %}{{ loop.index }}{{ m.content }}{{ y }}{% endgeneration %}"
        "{% endfor %}|{{ y }}|{{ ns.v }}"
    )
    assert ChatTemplate(scoped).render(messages) == "1Hi22Hello!23Bye2|1|3"
    assert ChatTemplate("{% generation %}\n  x\n{% endgeneration %}\ny").render([]) == "  x\ny"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ messages[0]['__class__'] }}",
        "{{ 'x' * 100000000 }}",
        "{{ [0] * 100000000 }}",
        "{{ 9 ** 999999999 }}",
        "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    ],
)
def test_sandbox_escapes_and_bombs_are_library_errors(source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x",
            "more than 20000000 steps",
        ),
        ("{% set ns = namespace(n=7) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}x", "bits"),
        ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n ** 9 %}{% endfor %}x", "bits"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "build"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}x", "built"),
        ("{{ messages[0].content|center(3000000000) }}", "center width"),
        ("{{ messages[0].content|indent(3000000000) }}", "indent width"),
        ("{{ '%3000000000d' % 1 }}", "format width"),
        ("{{ '%.3000000000f'|format(1.5) }}", "format width"),
        ("{{ ('a' * 1000000)|replace('a', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa') }}", "replace"),
    ],
    ids=["nested-ranges", "int-squaring", "int-power", "plus-doubling", "tilde-doubling", "center", "indent",
         "percent-width", "format-filter", "replace-growth"],
)  # fmt: skip
def test_a_template_s_work_and_sizes_are_bounded(source: str, needle: str) -> None:
    """The template comes from the model file: a loop, an integer or a string that would run for ever
    or take gigabytes is a ChatTemplateError at once."""
    with pytest.raises(ChatTemplateError, match=needle):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_the_work_bound_is_per_rendering() -> None:
    # 1.5 M range items per rendering: ten renderings stay within their own bounds
    template = ChatTemplate("{% for a in range(15) %}{% for b in range(100000) %}{% endfor %}{% endfor %}ok")
    assert [template.render([]) for _ in range(10)] == ["ok"] * 10


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ messages[5].content.x.y }}", "UndefinedError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ],
)
def test_runtime_failures_are_chat_template_errors(source: str, needle: str) -> None:
    with pytest.raises(ChatTemplateError, match=needle):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", ["hello", [("user", "hi")], {"role": "user"}, [None]])
def test_messages_must_be_a_list_of_mappings(messages: object) -> None:
    with pytest.raises(ChatTemplateError, match="messages"):
        ChatTemplate("{{ messages }}").render(messages)  # type: ignore[arg-type]


def test_tools_must_be_mappings() -> None:
    def weather(city: str) -> str:
        return city

    with pytest.raises(ChatTemplateError, match=r"tools\[0\]"):
        ChatTemplate("{{ tools }}").render([], tools=[weather])  # type: ignore[list-item]


def test_non_string_arguments_are_config_errors() -> None:
    with pytest.raises(aioexperts.ConfigError, match="source"):
        ChatTemplate(b"{{ x }}")  # type: ignore[arg-type]
    with pytest.raises(aioexperts.ConfigError, match="bos_token"):
        ChatTemplate("x", bos_token=1)  # type: ignore[arg-type]


def _vocab_file(
    path: Path, *, template: str | None, bos: int | None = 1, eos: int | None = 2, extra: dict[str, str] | None = None
) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "hello"])
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if template is not None:
        w.add_string("tokenizer.chat_template", template)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_from_gguf_reads_the_template_and_the_bos_eos_text(tmp_path: Path) -> None:
    path = _vocab_file(tmp_path / "v.gguf", template="{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    template = ChatTemplate.from_gguf(path)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_from_gguf_reads_a_named_template(tmp_path: Path) -> None:
    path = _vocab_file(
        tmp_path / "v.gguf", template="A", extra={"tokenizer.chat_template.tool_use": "B{{ tools | length }}"}
    )
    assert ChatTemplate.from_gguf(path, name="tool_use").render([], tools=[{"a": 1}]) == "B1"
    with pytest.raises(ChatTemplateError, match="tokenizer.chat_template.rag"):
        ChatTemplate.from_gguf(path, name="rag")


def test_from_gguf_without_bos_eos_ids_gives_empty_tokens(tmp_path: Path) -> None:
    path = _vocab_file(tmp_path / "v.gguf", template="[{{ bos_token }}|{{ eos_token }}]", bos=None, eos=None)
    assert ChatTemplate.from_gguf(path).render([]) == "[|]"


def test_a_bos_id_outside_the_vocabulary_is_a_format_error(tmp_path: Path) -> None:
    path = _vocab_file(tmp_path / "v.gguf", template="x", bos=4)
    with pytest.raises(aioexperts.FormatError, match="bos_token_id=4 is outside the 4 tokens"):
        ChatTemplate.from_gguf(path)


def test_a_file_without_a_template_names_the_way_to_pass_one(tmp_path: Path) -> None:
    path = _vocab_file(tmp_path / "v.gguf", template=None, extra={"tokenizer.chat_template.tool_use": "x"})
    with pytest.raises(
        ChatTemplateError, match=r"no tokenizer\.chat_template .*tool_use.*aioexperts\.ChatTemplate\(source"
    ):
        ChatTemplate.from_gguf(path)


@pytest.mark.skipif(not (VOCAB / "ggml-vocab-gpt-2.gguf").exists(), reason="no shared vocab")
def test_a_shared_vocabulary_without_a_template_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="has no tokenizer.chat_template"):
        ChatTemplate.from_gguf(VOCAB / "ggml-vocab-gpt-2.gguf")


def test_a_bos_text_read_from_a_large_vocabulary_left_in_the_file(tmp_path: Path) -> None:
    """Above 4096 tokens the header reader leaves the list in the file; the BOS/EOS text is read from it."""
    path = tmp_path / "big.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_token_list([f"tok{i}" for i in range(5000)])
    w.add_bos_token_id(4321)
    w.add_eos_token_id(4999)
    w.add_string("tokenizer.chat_template", "{{ bos_token }}|{{ eos_token }}")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ChatTemplate.from_gguf(path).render([]) == "tok4321|tok4999"


def test_without_jinja2_importing_works_and_rendering_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys; sys.modules['jinja2'] = None\n"
        "import aioexperts\n"
        "try:\n    aioexperts.ChatTemplate('x')\n"
        "except aioexperts.ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'aioexperts[text]'" in out
    monkeypatch.setattr(chat_module, "_ENV", None)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(aioexperts.ConfigError, match="jinja2"):
        ChatTemplate("x")


def test_the_text_names_are_public() -> None:
    names = {"ChatTemplate", "ChatTemplateError", "SampledToken", "Sampler", "SamplingOptions", "StopMatcher"}
    assert names <= set(aioexperts.__all__)
    assert issubclass(aioexperts.ChatTemplateError, aioexperts.AioExpertsError)
