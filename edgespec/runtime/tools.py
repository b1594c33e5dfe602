"""Tool calls (function calling): the tools rendered by the package's own chat template, the
model's calls constrained by a grammar of the tools' parameter schemas (grammar.py), and the
answer parsed back into calls.

A template's tool format is read from its source; two are known:

- ``hermes`` (Qwen2.5, Hermes, and templates that write ``<tool_call>`` blocks): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several in a row;
- ``llama3`` (Llama 3.1-3.3's JSON tool calling): the whole answer is one ``{"name": ...,
  "parameters": {...}}``.

A template with neither has no tool format: ``tool_format`` is None and tools are refused.

The grammar by ``tool_choice``: "required" or a named function, the answer is call(s) of those
tools, each fitting its parameter schema; "auto", free text with no call in it, or (hermes)
text then calls, or (llama3) one call, so a started call is constrained; "none", free text with
no call. Exactness is the constraint's (grammar.py): the output is the target's distribution
restricted to that grammar, with or without drafting.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from edgespec.config import Constraint
from edgespec.errors import GenerationError

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(GenerationError):
    """Tools a request cannot have: malformed, unknown, or a template without a tool format."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of its arguments (an object)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI gives it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def read_tools(tools: object) -> list[Tool]:
    """OpenAI's ``tools`` (``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``) checked: each a function with a name and an object schema."""
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1 to {MAX_TOOLS} functions")
    found, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(function, dict)):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not (isinstance(name, str) and NAME.fullmatch(name)):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.add(name)
        found.append(Tool(name, parameters))
    return found


def chosen(tools: list[Tool], choice: object) -> tuple[str, list[Tool]]:
    """tool_choice as (mode, the tools a call may name): "auto" (the default), "none",
    "required", or ``{"type": "function", "function": {"name": ...}}`` ("required" of it)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", tools
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise ToolError('tool_choice must be "auto", "none", "required" or {"type": '
                        '"function", "function": {"name": ...}}')
    named = [tool for tool in tools if tool.name == name]
    if not named:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
    return "required", named


class ToolFormat:
    """How a template's model writes calls: the grammar and the parser."""

    name = ""
    arguments_key = "arguments"

    def call_schema(self, tools: Sequence[Tool]) -> dict:
        """One call's JSON: the name of one of ``tools`` and arguments fitting its schema."""
        # separators as json.dumps and templates' tojson write them, no other whitespace:
        # the calls a model was trained on, and fewer positions for it to choose
        return {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                               "key_separator": ": "},
                "anyOf": [{"type": "object", "properties": {
            "name": {"const": tool.name}, self.arguments_key: tool.parameters},
            "required": ["name", self.arguments_key], "additionalProperties": False}
            for tool in tools]}

    def constraint(self, mode: str, tools: Sequence[Tool], parallel: bool) -> Constraint:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of an answer: calls that do not parse stay text."""
        raise NotImplementedError


def _call(name: str, arguments: object) -> ToolCall:
    return ToolCall(f"call_{secrets.token_hex(12)}", name, json.dumps(arguments,
                                                                       ensure_ascii=False))


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def constraint(self, mode: str, tools: Sequence[Tool], parallel: bool) -> Constraint:
        plain = 'PLAIN: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n'
        if mode == "none":
            return Constraint("lark", "start: PLAIN\n" + plain)
        body = '"\\n" %json ' + json.dumps(self.call_schema(tools)) + ' "\\n</tool_call>"'
        more = ' ("\\n" "<tool_call>" call_rest)*' if parallel else ""
        rules = f"call_rest: {body}\n"
        if mode == "required":
            return Constraint("lark", f'start: "<tool_call>" call_rest{more}\n{rules}')
        return Constraint("lark", f'start: PLAIN | lead call_rest{more}\n'
                          f'lead[suffix="<tool_call>"]: /(?s:.*)/\n{rules}{plain}')

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        for block in self.BLOCK.findall(text[start:]):
            try:
                call = json.loads(block)
            except ValueError:
                return text, []
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return text, []
            calls.append(_call(call["name"], call.get("arguments", {})))
        if not calls:  # an opened call the answer never closed (cut by max_tokens)
            return text, []
        content = text[:start].strip()
        return content or None, calls


class Llama3(ToolFormat):
    name = "llama3"
    arguments_key = "parameters"

    def constraint(self, mode: str, tools: Sequence[Tool], parallel: bool) -> Constraint:
        plain = "PLAIN: /(?s:[^{].*)?/\n"  # text that does not open a call's JSON
        call = "%json " + json.dumps(self.call_schema(tools))
        if mode == "none":
            return Constraint("lark", "start: PLAIN\n" + plain)
        if mode == "required":  # one call per answer: the format has no second
            return Constraint("lark", f"start: {call}\n")
        return Constraint("lark", f"start: PLAIN | {call}\n{plain}")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        try:
            call = json.loads(stripped)
        except ValueError:
            return text, []
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) \
            else None
        if not (isinstance(call.get("name"), str) and isinstance(arguments, dict)):
            return text, []
        return None, [_call(call["name"], arguments)]


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The tool format a chat template writes calls in, None if it has none."""
    if not template_source or "tools" not in template_source:
        return None
    if Hermes.OPEN in template_source:
        return Hermes()
    if '"parameters"' in template_source or "ipython" in template_source:
        return Llama3()
    return None


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI's messages as templates read them (transformers' convention, as vLLM passes
    them): an assistant's ``tool_calls`` with ``function.arguments`` parsed from its JSON text
    into an object; a tool result keeps its ``tool_call_id``."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            parsed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                arguments = function.get("arguments") if isinstance(function, dict) else None
                try:
                    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    arguments = None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                        and isinstance(arguments, dict)):
                    raise ToolError(f"messages[{i}].tool_calls[{j}] must be a function call "
                                    "with a name and JSON object arguments")
                parsed.append({"id": call.get("id"), "type": "function",
                               "function": {"name": function["name"], "arguments": arguments}})
            message = {**message, "tool_calls": parsed}
        out.append(message)
    return out
