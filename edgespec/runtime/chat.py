"""A conversation as the token ids a chat model reads: the package's chat template rendered,
then tokenized without the tokenizer's own special tokens (inputs.py's ``encode_text``, the
one rule: the template writes its own, BOS included).

``render_chat`` is the one rendering, done in the child process of bounded_text.py (bounded
in time and memory: the template comes with the package) for the server and, through
``chat_prompt_ids``, for the library and the command line.

The template itself (a bounded Jinja sandbox, as transformers renders it) is
chat_template.py's ``ChatTemplate``; it needs only jinja2, imported on first use so that
``import edgespec`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from edgespec.errors import ChatTemplateError, GenerationError
from edgespec.manifest import Manifest

if TYPE_CHECKING:
    from edgespec.runtime.bounded_text import BoundedText
    from edgespec.runtime.chat_template import ChatTemplate


def load_chat_template(folder: Path, manifest: Manifest) -> ChatTemplate:
    """The package's chat template, compiled; a ChatTemplateError if it has none (or it does
    not compile), saying what to do instead."""
    from edgespec.runtime.chat_template import ChatTemplate

    template = ChatTemplate.of_package(folder, manifest)
    if template is None:
        raise ChatTemplateError(
            f"{folder} has no chat template; use edgespec generate for plain text, or "
            "re-export from a checkpoint whose tokenizer has one")
    return template


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """A conversation as templates read it: a non-empty list of dicts, each with a ``role``
    and a ``content`` string (other keys are passed to the template as they are)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise GenerationError(
            'messages must be a non-empty list of {"role": ..., "content": ...} dicts, got '
            f"{type(messages).__name__}{' (empty)' if not messages else ''}")
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("content") is None and isinstance(
                message.get("tool_calls"), list):  # an assistant's calls, with no text
            continue
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise GenerationError(
                f"messages[{i}] must be a dict with a 'role' and a 'content' string, "
                f"got {message!r:.80}")
    return list(messages)


def render_chat(template: ChatTemplate, messages: Sequence[dict],
                tools: list[dict] | None = None) -> str:
    """The conversation as text, ending where the assistant's answer starts; its special
    tokens are written by the template, so the text is tokenized without the tokenizer's.
    ``tools``: the functions offered (runtime/tools.py), rendered by the template."""
    return template.render(check_messages(messages), tools)


def chat_prompt_ids(template: ChatTemplate, text: BoundedText,
                    messages: Sequence[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation rendered (``render_chat``) and tokenized without special tokens, in
    ``text``'s bounded child process."""
    ids = text.render(check_messages(messages), tools)
    if not ids:
        raise GenerationError(f"the chat template {template.name} rendered the conversation "
                              "as no tokens at all")
    return ids
