"""Chat templates: a GGUF's ``tokenizer.chat_template`` rendered with jinja2, the way transformers does.

The environment follows ``transformers.utils.chat_template_utils._compile_jinja_template`` and
``render_jinja_template``: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), the
``{% generation %}...{% endgeneration %}`` block (transformers' ``AssistantTracker``, which marks the
assistant's tokens for training masks: its body is rendered as is, the marks are not kept), a ``tojson``
filter that calls ``json.dumps`` without ASCII escaping (and takes ``indent``, ``separators``,
``sort_keys``), the globals ``raise_exception(message)`` and ``strftime_now(format)``, and the
variables ``messages``, ``tools``, ``documents`` (None), ``add_generation_prompt``, ``bos_token``
and ``eos_token``.

Where this module is stricter than transformers it says so: reaching an unsafe attribute
(``''.__class__``, ``messages.append``) raises at once instead of giving an undefined value;
``*`` and ``**`` refuse results beyond :data:`MAX_REPEAT` items or exponents beyond
:data:`MAX_EXPONENT`; and a rendering longer than :data:`MAX_OUTPUT_CHARS` stops. A template comes
from the model file, so its work is bounded too (:data:`MAX_STEPS`, :data:`MAX_SECONDS`): every
``range`` counts its items and every attribute, item or call one step; strings and lists built by
``+``, ``%``, ``center``, ``indent``, ``format`` or ``replace`` stay within :data:`MAX_OUTPUT_CHARS`,
and integers built by ``*`` and ``**`` within :data:`MAX_INT_BITS` bits. Every failure
reaches the caller as :class:`~aioexperts._errors.ChatTemplateError` with the template's own
message. jinja2 is an optional dependency (``pip install 'aioexperts[text]'``); it is imported
when the first template is compiled.
"""

from __future__ import annotations

import contextvars
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

from .._errors import ChatTemplateError, ConfigError, FormatError
from .._format.header import LossyStr, SkippedValue, read_header
from .._json import dumps as strict_dumps

__all__ = (
    "MAX_EXPONENT",
    "MAX_INT_BITS",
    "MAX_OUTPUT_CHARS",
    "MAX_REPEAT",
    "MAX_SECONDS",
    "MAX_STEPS",
    "RESERVED_VARIABLES",
    "ChatTemplate",
)

#: Longest rendering accepted, in characters.
MAX_OUTPUT_CHARS = 16 << 20
#: Longest string or list that ``*`` may build inside a template.
MAX_REPEAT = 1 << 20
#: Largest integer exponent ``**`` accepts inside a template.
MAX_EXPONENT = 1024
#: Largest integer (in bits) ``*`` and ``**`` may build inside a template.
MAX_INT_BITS = 1 << 16
#: Work of one rendering: items of every ``range`` plus attribute, item and call steps.
MAX_STEPS = 20_000_000
#: Wall time of one rendering, checked at each step.
MAX_SECONDS = 10.0

_TEMPLATE_KEY = "tokenizer.chat_template"

RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)
"""The variables :meth:`ChatTemplate.render` sets itself (``extra`` may not)."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: json.dumps as is (jinja's own filter escapes <, >, & and '); strict: NaN is null
    return strict_dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the template calls it with this name)
    return datetime.now().strftime(format)


class _Budget:
    """What is left of one rendering's work (:data:`MAX_STEPS`, :data:`MAX_SECONDS`)."""

    __slots__ = ("deadline", "steps")

    def __init__(self) -> None:
        self.steps = MAX_STEPS
        self.deadline = time.monotonic() + MAX_SECONDS


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("aioexperts_template_budget", default=None)
_FORMAT_WIDTHS = re.compile(r"%[-#0 +]*(\d+)(?:\.(\d+))?|%[-#0 +]*\.(\d+)")


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.filters
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need jinja2: pip install 'aioexperts[text]'") from None

    def raise_exception(message: object) -> None:
        raise jinja2.TemplateError(str(message))

    def charge(n: int) -> None:
        budget = _BUDGET.get()
        if budget is None:
            return
        budget.steps -= n
        if budget.steps < 0:
            raise SecurityError(f"the template did more than {MAX_STEPS} steps (range items, attributes, calls)")
        if time.monotonic() > budget.deadline:
            raise SecurityError(f"the template ran longer than {MAX_SECONDS:g} s")

    def sized(value: Any) -> Any:
        if isinstance(value, str | list | tuple) and len(value) > MAX_OUTPUT_CHARS:
            raise SecurityError(f"the template built a value of {len(value)} items (at most {MAX_OUTPUT_CHARS})")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise SecurityError(f"the template built an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")
        return value

    def width(value: Any, what: str) -> None:
        if isinstance(value, int | str) and str(value).strip().lstrip("-").isdigit():
            if abs(int(value)) > MAX_OUTPUT_CHARS:
                raise SecurityError(f"{what} of {value} (at most {MAX_OUTPUT_CHARS})")

    def format_widths(fmt: Any) -> None:
        if isinstance(fmt, str):
            for m in _FORMAT_WIDTHS.finditer(fmt):
                for digits in m.groups():
                    if digits is not None:
                        width(digits, "a '%' format width")

    def budget_range(*args: Any) -> range:
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise OverflowError(f"range too big, at most {MAX_RANGE} items")
        charge(len(r))
        return r

    def checked_filter(name: str, check: Callable[..., None]) -> Callable[..., Any]:
        inner = jinja2.filters.FILTERS[name]

        def run(*args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            return sized(inner(*args, **kwargs))

        run.__dict__.update(inner.__dict__)  # jinja's pass_eval_context / pass_environment marks
        return run

    def check_center(value: Any, width_: Any = 80) -> None:
        width(width_, "center width")

    def check_indent(s: Any, width_: Any = 4, *args: Any, **kwargs: Any) -> None:
        width(width_, "indent width")
        if isinstance(width_, str) and len(width_) * (str(s).count("\n") + 1) > MAX_OUTPUT_CHARS:
            raise SecurityError("indent would build more than the output limit")

    def check_format(value: Any, *args: Any, **kwargs: Any) -> None:
        format_widths(value)

    def check_replace(ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            n = len(s) + 1 if not old else s.count(old)
            if isinstance(count, int) and count >= 0:
                n = min(n, count)
            if len(s) + n * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
                raise SecurityError("replace would build more than the output limit")

    class _Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**", "+", "%"))

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def getattr(self, obj: Any, attribute: str) -> Any:
            charge(1)
            return sized(super().getattr(obj, attribute))

        def getitem(self, obj: Any, argument: Any) -> Any:
            charge(1)
            return sized(super().getitem(obj, argument))

        def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            charge(1)
            return sized(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            charge(1)
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(count, int):
                        if len(seq) * max(count, 0) > MAX_REPEAT:
                            raise SecurityError(f"'*' would build {len(seq) * count} items (at most {MAX_REPEAT})")
                if isinstance(left, int) and isinstance(right, int):
                    if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                        raise SecurityError(f"'*' would build an integer of more than {MAX_INT_BITS} bits")
            elif operator == "**":
                if isinstance(right, int) and abs(right) > MAX_EXPONENT:
                    raise SecurityError(f"'**' with exponent {right} (at most {MAX_EXPONENT})")
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
                    raise SecurityError(f"'**' would build an integer of more than {MAX_INT_BITS} bits")
            elif operator == "+":
                if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                    if len(left) + len(right) > MAX_OUTPUT_CHARS:
                        raise SecurityError(f"'+' would build more than {MAX_OUTPUT_CHARS} items")
            elif operator == "%":
                format_widths(left)
            return sized(super().call_binop(context, operator, left, right))

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}`` renders ``body`` (transformers' ``AssistantTracker``
        also records where it lies, for ``return_assistant_tokens_mask``; nothing here needs that)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.filters["center"] = checked_filter("center", check_center)
    env.filters["indent"] = checked_filter("indent", check_indent)
    env.filters["format"] = checked_filter("format", check_format)
    env.filters["replace"] = checked_filter("replace", check_replace)
    env.globals["range"] = budget_range
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV: Any = None


def _shared_environment() -> Any:
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    return _ENV


def _template_error(exc: Exception) -> ChatTemplateError:
    where = getattr(exc, "lineno", None)
    kind = type(exc).__name__
    at = f" (line {where})" if where else ""
    return ChatTemplateError(f"chat template {kind}{at}: {exc}")


class ChatTemplate:
    """A compiled chat template (jinja2, transformers' rules; see the module docstring).

    Args:
        source: the template text (a GGUF's ``tokenizer.chat_template``, a ``tokenizer_config.json``'s
            ``chat_template``).
        bos_token: the text the template sees as ``bos_token`` (the BOS token's text).
        eos_token: the text the template sees as ``eos_token``.

    Raises:
        ChatTemplateError: ``source`` is not a valid template (the message carries jinja2's, with
            the line).
        ConfigError: jinja2 is not installed, or an argument is not a string.
    """

    __slots__ = ("_compiled", "bos_token", "eos_token", "source")

    #: The variables :meth:`render` sets itself (``extra`` may not).
    reserved_variables: ClassVar[frozenset[str]] = RESERVED_VARIABLES

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        for name, value in (("source", source), ("bos_token", bos_token), ("eos_token", eos_token)):
            if not isinstance(value, str):
                raise ConfigError(f"ChatTemplate {name} must be a str, got {type(value).__name__}")
        env = _shared_environment()
        import jinja2

        try:
            self._compiled = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise _template_error(exc) from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, name: str | None = None) -> ChatTemplate:
        """The chat template a GGUF file carries, with its BOS and EOS tokens' text.

        Reads only the header (``aioexperts._format.header.read_header``, every read bounded by the
        file size) and, for a vocabulary too large to decode up front, the strings of the token list
        up to the BOS/EOS ids.

        Args:
            path: the GGUF file (a vocabulary-only file is enough).
            name: a named template (``tokenizer.chat_template.NAME``, e.g. ``tool_use``) instead of
                the default one.

        Returns:
            The compiled template; ``bos_token``/``eos_token`` are the texts of
            ``tokenizer.ggml.bos_token_id``/``eos_token_id`` ("" when the file has no such id).

        Raises:
            ChatTemplateError: the file has no such template (the message says to pass one with
                ``ChatTemplate(source, ...)``), or the template does not compile.
            FormatError: the file is malformed, the template is not UTF-8, a BOS/EOS id is outside
                the token list.
            OSError: the file cannot be read.
        """
        fspath = os.fspath(path)
        header = read_header(fspath)
        key = _TEMPLATE_KEY if name is None else f"{_TEMPLATE_KEY}.{name}"
        source = header.metadata.get(key)
        if source is None:
            names = sorted(k[len(_TEMPLATE_KEY) + 1 :] for k in header.metadata if k.startswith(_TEMPLATE_KEY + "."))
            others = f" (it has the named templates {names})" if names else ""
            raise ChatTemplateError(
                f"{fspath} has no {key}{others}: pass the template yourself, "
                "aioexperts.ChatTemplate(source, bos_token=..., eos_token=...)"
            )
        if isinstance(source, SkippedValue) or not isinstance(source, str) or isinstance(source, LossyStr):
            raise FormatError(f"{fspath}: {key} is not a UTF-8 string of at most 64 MiB")
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        texts = []
        for which in ("bos", "eos"):
            token_id = header.metadata.get(f"tokenizer.ggml.{which}_token_id")
            texts.append("" if token_id is None else _token_text(fspath, tokens, token_id, which))
        return cls(source, bos_token=texts[0], eos_token=texts[1])

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, as transformers' ``render_jinja_template`` gives it.

        Args:
            messages: the conversation, each a mapping with ``role`` and ``content`` (and whatever
                else the template reads: ``tool_calls``, ``name``...). Nothing is changed.
            add_generation_prompt: end with the header of an assistant turn.
            tools: JSON schemas of the tools (``{"type": "function", "function": {...}}``), as the
                template's ``tools``; None gives ``tools = None``.
            extra: more variables for the template (transformers' ``**kwargs``, the server's
                ``chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``...); the names
                above (:data:`RESERVED_VARIABLES`) are refused.

        Returns:
            The rendered text (special tokens as text; tokenize it with special-token parsing on).

        Raises:
            ChatTemplateError: the template called ``raise_exception`` (its message), failed while
                rendering (an undefined value used as a mapping, a type error), tried an unsafe
                attribute, or gave more than :data:`MAX_OUTPUT_CHARS` characters; or ``messages``
                or ``tools`` is not a list of mappings, or ``extra`` names a reserved variable.
        """
        _check_mappings("messages", messages)
        extra = dict(extra or {})
        taken = sorted(set(extra) & RESERVED_VARIABLES)
        if taken:
            raise ChatTemplateError(f"template variable {taken[0]!r} is set by the renderer, not by extra variables")
        if tools is not None:
            _check_mappings("tools", tools)
        import jinja2

        parts: list[str] = []
        size = 0
        token = _BUDGET.set(_Budget())
        try:
            for part in self._compiled.generate(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=bool(add_generation_prompt),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            ):
                size += len(part)
                if size > MAX_OUTPUT_CHARS:
                    raise ChatTemplateError(f"chat template rendered more than {MAX_OUTPUT_CHARS} characters")
                parts.append(part)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise _template_error(exc) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as exc:
            raise _template_error(exc) from exc
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory") from None
        finally:
            _BUDGET.reset(token)
        return "".join(parts)

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, bos_token={self.bos_token!r}, eos_token={self.eos_token!r})"


def _check_mappings(what: str, items: object) -> None:
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
        raise ChatTemplateError(f"{what} must be a list of mappings, got {type(items).__name__}")
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ChatTemplateError(f"{what}[{index}] must be a mapping, got {type(item).__name__}")


def _token_text(path: str, tokens: object, token_id: object, which: str) -> str:
    """The text of token ``token_id`` from ``tokenizer.ggml.tokens`` (a list, or left in the file)."""
    key = f"tokenizer.ggml.{which}_token_id"
    if tokens is None:
        raise FormatError(f"{path}: {key} is set but the file has no tokenizer.ggml.tokens")
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < len(tokens):  # type: ignore[arg-type]
        raise FormatError(f"{path}: {key}={token_id!r} is outside the {len(tokens)} tokens")  # type: ignore[arg-type]
    if isinstance(tokens, list):
        text = tokens[token_id]
    elif isinstance(tokens, SkippedValue) and tokens.item_type is not None and tokens.item_type.name == "STRING":
        text = _string_at(path, tokens, token_id)
    else:
        raise FormatError(f"{path}: tokenizer.ggml.tokens is not an array of strings")
    if not isinstance(text, str):
        raise FormatError(f"{path}: token {token_id} ({key}) is not a string")
    return str(text)


def _string_at(path: str, value: SkippedValue, index: int) -> str:
    """Item ``index`` of a string array left in the file (``u64`` length + bytes per item).

    The header reader has already walked these bytes and checked them against the file size; this
    walks them again, within ``value.n_bytes``.
    """
    with open(path, "rb") as f:
        f.seek(value.offset)
        data = f.read(value.n_bytes)
    if len(data) != value.n_bytes:
        raise FormatError(f"{path}: the file shrank while {value.key} was read")
    view = memoryview(data)
    pos = 0
    for _ in range(index):
        n = int.from_bytes(view[pos : pos + 8], "little")
        pos += 8 + n
        if pos > len(data):
            raise FormatError(f"{path}: {value.key} ends inside item {index}")
    n = int.from_bytes(view[pos : pos + 8], "little")
    if pos + 8 + n > len(data):
        raise FormatError(f"{path}: {value.key} ends inside item {index}")
    raw = bytes(view[pos + 8 : pos + 8 + n])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{path}: token {index} of {value.key} is not valid UTF-8") from None
