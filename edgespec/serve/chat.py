"""A package's chat template, rendered the way transformers renders it.

transformers (``utils/chat_template_utils.py``) compiles a tokenizer's template in a sandboxed
Jinja environment that cannot touch Python objects' internals, with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that keeps non-ASCII text,
``raise_exception`` and ``strftime_now``; it renders with ``messages``,
``add_generation_prompt`` and the tokenizer's special token strings (``bos_token``, ...), and
tokenizes the result without adding special tokens: the template writes them itself.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import EdgespecError
from edgespec.manifest import Manifest


class ChatTemplateError(EdgespecError):
    """The package has no chat template, or its template refused the conversation."""


class ChatTemplate:
    """The Jinja template of a package's target tokenizer, compiled once."""

    def __init__(self, source: str, special_tokens: dict):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens)

    @classmethod
    def of_package(cls, folder: Path, manifest: Manifest) -> ChatTemplate | None:
        """The package's template, or None if it was exported without one."""
        if manifest.chat_template is None:
            return None
        source = (Path(folder) / manifest.chat_template).read_text(encoding="utf-8")
        try:
            return cls(source, manifest.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the package's chat template does not compile ({e}); "
                                    "re-export the pair") from None

    def render(self, messages: list[dict]) -> str:
        """The conversation as the prompt text, ending where the assistant's answer starts."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        tools=None, documents=None, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
