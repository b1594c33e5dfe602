"""A package's chat template, rendered the way transformers renders it, within bounds.

transformers (``utils/chat_template_utils.py``) compiles a tokenizer's template in a sandboxed
Jinja environment that cannot touch Python objects' internals, with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that keeps non-ASCII text,
``raise_exception`` and ``strftime_now``; it renders with ``messages``,
``add_generation_prompt`` and the tokenizer's special token strings (``bos_token``, ...), and
tokenizes the result without adding special tokens: the template writes them itself.

A template comes with the package, so it may be hostile: the sandbox here also caps what one
operation can build (``range``, ``*``, ``**``, ``%`` and ``+`` on strings and lists,
``strftime_now``) and the size of the output, and every fault is a ChatTemplateError naming the
template. What no sandbox can bound from inside (time, and memory spent in C code such as a
filter's width) is bounded by rendering in a child process (bounded_text.py).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.config import is_int
from edgespec.errors import ChatTemplateError, shown
from edgespec.manifest import Manifest

RANGE_ITEMS = 10_000  # a template loops over messages, not millions of numbers
INTEGER_BITS = 4096  # the largest integer * or ** may make
STRFTIME_CHARS = 256
# a %-format's width or precision: a number, or * taken from the arguments
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _UnfoldedCodeGenerator(CodeGenerator):
    """Jinja's compiler, folding no expression but plain text into constants: Jinja's
    optimizer and its output step evaluate a constant expression while compiling, so
    ``{{ 'x'|center(1500000000) }}`` would cost its gigabytes in whichever process compiles
    the template (the server at start-up, ``edgespec chat``). Unfolded, it runs when rendered,
    in the rendering process, under its bounds (bounded_text.py)."""

    def _output_child_to_const(self, node, frame, finalize):
        if not isinstance(node, nodes.TemplateData):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with what one expression may build capped: ``range`` to
    RANGE_ITEMS, a string or list made by ``*``, ``+`` or ``%`` to ``max_chars`` items, an
    integer made by ``*`` or ``**`` to INTEGER_BITS bits. Past a cap: SecurityError."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _UnfoldedCodeGenerator

    def __init__(self, max_chars: int, **options):
        super().__init__(**options)
        self.max_chars = max_chars
        self.globals["range"] = self._range

    def _range(self, *args: int) -> range:
        numbers = range(*args)
        if len(numbers) > RANGE_ITEMS:
            raise SecurityError(f"range() of {len(numbers)} items; at most {RANGE_ITEMS}")
        return numbers

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            self._check_product(left, right)
        elif operator == "**":
            self._check_power(left, right)
        elif operator == "+" and _sized(left) and _sized(right):
            self._check_size(len(left) + len(right), "+")
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def _check_size(self, size: int, operator: str) -> None:
        if size > self.max_chars:
            raise SecurityError(f"{operator} would make {size} items; at most {self.max_chars}")

    def _check_product(self, left, right) -> None:
        for seq, times in ((left, right), (right, left)):
            if _sized(seq) and is_int(times):
                return self._check_size(len(seq) * max(times, 0), "*")
        if is_int(left) and is_int(right) and (
                left.bit_length() + right.bit_length() > INTEGER_BITS):
            raise SecurityError(f"* would make an integer over {INTEGER_BITS} bits")

    def _check_power(self, base, exponent) -> None:
        if is_int(base) and is_int(exponent) and abs(base) > 1 and (
                exponent * base.bit_length() > INTEGER_BITS):
            raise SecurityError(f"** would make an integer over {INTEGER_BITS} bits")

    def _check_percent(self, form: str, values) -> None:
        for width in _PERCENT_FIELD.finditer(form):
            for number in width.groups():
                if number == "*" or (number and int(number) > self.max_chars):
                    raise SecurityError(f"a %-format width or precision over {self.max_chars}")


def _sized(value) -> bool:
    return isinstance(value, (str, list, tuple))



class ChatTemplate:
    """The Jinja template of a package's target tokenizer, compiled once. ``name``: the file it
    came from, which every error names; ``max_chars``: the longest text a render may write."""

    def __init__(self, source: str, special_tokens: dict, name: str = "chat template",
                 max_chars: int = 1 << 20):
        self.name, self.max_chars = name, max_chars
        # optimized=False: the optimizer's folding, like the output step's, would run the
        # template's constant expressions in the compiling process (_UnfoldedCodeGenerator)
        env = BoundedEnvironment(max_chars, trim_blocks=True, lstrip_blocks=True,
                                 extensions=[loopcontrols], optimized=False)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"the package's chat template {name} does not compile "
                                    f"({_said(e)}); re-export the pair") from None
        self.special_tokens = dict(special_tokens)

    @classmethod
    def of_package(cls, folder: Path, manifest: Manifest,
                   max_chars: int = 1 << 20) -> ChatTemplate | None:
        """The package's template, or None if it was exported without one."""
        if manifest.chat_template is None:
            return None
        path = Path(folder) / manifest.chat_template
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read the chat template {path} "
                                    f"({_said(e)}); "
                                    "re-export the pair") from None
        return cls(source, manifest.special_tokens, Path(manifest.chat_template).name, max_chars)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation as the prompt text, ending where the assistant's answer starts;
        any fault of the template, or output past ``max_chars``, is a ChatTemplateError.
        ``tools``: the functions the model may call, as transformers passes them
        (``[{"type": "function", "function": {...}}]``), None: none."""
        pieces, size = [], 0
        try:
            for piece in self.template.generate(
                    messages=messages, add_generation_prompt=True, tools=tools, documents=None,
                    **self.special_tokens):
                size += len(piece)
                if size > self.max_chars:
                    raise OutputTooLong(size)
                pieces.append(piece)
        except OutputTooLong:
            raise ChatTemplateError(
                f"the chat template {self.name} wrote more than {self.max_chars} characters "
                "for this conversation, more than the context window can hold") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"the chat template {self.name} refused the messages: "
                f"{_said(e)}") from None
        except MemoryError:  # past the rendering process's limit (bounded_text.py)
            raise ChatTemplateError(f"the chat template {self.name} ran out of memory "
                                    "rendering the conversation") from None
        except Exception as e:  # RecursionError, OverflowError, a filter's fault
            raise ChatTemplateError(f"the chat template {self.name} failed "
                                    f"({type(e).__name__}: {_said(e)})") from None
        return "".join(pieces)


def _said(error: BaseException) -> str:
    """What a template's fault says, as a message may show it: the text comes from the
    template (raise_exception's message, a line of its source), so it is quoted with its
    control characters escaped (a terminal's escape sequences among them) and cut."""
    return shown(str(error), 300)


class OutputTooLong(Exception):
    """A render wrote past its limit."""



def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(form: str) -> str:
    if not isinstance(form, str) or len(form) > STRFTIME_CHARS:
        raise SecurityError(f"strftime_now takes a format of at most {STRFTIME_CHARS} characters")
    return datetime.now().strftime(form)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
