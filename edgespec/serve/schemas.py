"""The request bodies of the OpenAI API as pydantic models: a body that does not fit is refused
by the schema, with the field's name, before anything else looks at it.

Fields as OpenAI defines them (its API reference, "Completions" and "Chat"), then edgespec's
own: top_k, min_p, repetition_penalty, draft_length, schedule, drafter, ignore_eos,
token_healing (a text prompt of /v1/completions only; runtime/healing.py), named as
GenerationConfig's fields. Unknown fields are ignored, as OpenAI's
clients send some that change nothing here; those that would change the output and that
edgespec cannot honour (penalties, logprobs, several choices) are refused by ``unsupported``.
"""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edgespec.config import (
    DRAFTERS,
    MAX_DRAFT_LENGTH,
    SCHEDULES,
    Constraint,
    GenerationConfig,
)
from edgespec.serve.errors import shown

_DEFAULTS = GenerationConfig()
MAX_STOPS, STOP_CHARS = 4, 256  # stop sequences: how many, how long


class _Body(BaseModel):
    # strict: "16" is not a number and 1.0 not an integer; JSON gives every type exactly
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class Settings(_Body):
    """What both endpoints take besides their prompt."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # omitted: the package's defaults (its generation_config.json), else greedy (temperature 0,
    # top_p 1), as in the library and the CLI (config.resolve_sampling; app._sampling), not
    # OpenAI's 1 and 1; OpenAI's range; 0 is greedy
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    # OpenAI's penalties, its range (config.SamplingConfig); omitted: the package's, else 0
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's, refused unless they change nothing
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    # edgespec's own
    top_k: int | None = Field(None, ge=0)  # omitted: the package's default, else 0 (all)
    # llama.cpp's and vLLM's min-p (config.SamplingConfig); omitted: the package's, else 0
    min_p: float | None = Field(None, ge=0, le=1)
    # transformers' and vLLM's (llama-server's repeat_penalty); omitted: the package's, else 1
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    draft_length: int = Field(_DEFAULTS.draft_length, ge=1, le=MAX_DRAFT_LENGTH)
    schedule: Literal[SCHEDULES] = _DEFAULTS.schedule  # type: ignore[valid-type]
    drafter: Literal[DRAFTERS] = _DEFAULTS.drafter  # type: ignore[valid-type]
    ignore_eos: bool = False
    token_healing: bool = _DEFAULTS.token_healing
    # OpenAI's structured output (vLLM takes it for completions too): ``constraint``
    response_format: dict | None = None

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """OpenAI's limit, up to 4 stop sequences; each is matched against every round's text,
        so thousands of them would slow the one generation everyone waits for."""
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(s) > STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {STOP_CHARS} characters")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stop

    def drafting(self) -> dict:
        """draft_length and drafter as GenerationConfig takes them."""
        return {"draft_length": self.draft_length, "drafter": self.drafter}

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first setting edgespec cannot honour, or None."""
        if self.n != 1:
            return "n", f"n must be 1 (one choice per request), got {self.n}; send n requests"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        if (problem := self._response_format_problem()) is not None:
            return "response_format", problem
        return None

    def _response_format_problem(self) -> str | None:
        """What is wrong with response_format as OpenAI defines it: {"type": "text"},
        {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
        "strict", "description"}}; None if nothing."""
        form = self.response_format
        if form is None or form in ({"type": "text"}, {"type": "json_object"}):
            return None
        if form.get("type") != "json_schema":
            return ('response_format must be {"type": "text"}, {"type": "json_object"} or '
                    '{"type": "json_schema", "json_schema": {...}}, got ' + shown(form))
        spec = form.get("json_schema")
        if set(form) != {"type", "json_schema"} or not isinstance(spec, dict):
            return 'a json_schema response_format is {"type": "json_schema", "json_schema": ' \
                   '{"name": ..., "schema": {...}}}'
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        name = spec.get("name")
        if unknown:
            return f"response_format.json_schema has unknown field(s) {', '.join(sorted(unknown))}"
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)):
            return ("response_format.json_schema.name must be 1-64 letters, digits, _ or -, "
                    f"got {shown(name)}")
        if not isinstance(spec.get("schema", {}), dict):
            return "response_format.json_schema.schema must be a JSON schema object"
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            return "response_format.json_schema.strict must be true or false"
        return None

    def constraint(self) -> Constraint | None:
        """response_format as a config.Constraint (checked by ``unsupported`` first): any JSON
        object, or the schema given (omitted: any JSON value, as OpenAI reads it)."""
        form = self.response_format or {}
        if form.get("type") == "json_object":
            return Constraint("json_object")
        if form.get("type") == "json_schema":
            return Constraint.json_schema(form["json_schema"].get("schema", {}))
        return None


class CompletionRequest(Settings):
    """POST /v1/completions. ``prompt``: text, token ids, or a list of one of either."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", (f"a batch of {len(self.prompt)} prompts is not supported; "
                                  "send one prompt per request")
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls (runtime/tools.py renders them)
    tool_call_id: str | None = None  # a tool's result: the call it answers
    function_call: dict | None = None  # the older form: refused, never dropped in silence

    def unsupported(self) -> str | None:
        """The function-calling field this message carries that edgespec does not take."""
        if self.function_call is not None:
            return "function_call"
        return None

    def as_template_input(self) -> dict:
        """The message as chat templates read it: role and content as one string, and an
        assistant's calls or a tool result's id where given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(Settings):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    tools: list[dict] | None = None  # runtime/tools.py reads them, with the template's format
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    functions: list[dict] | None = None  # the older names of tools and tool_choice
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice not in (None, "none") and not self.tools:
            return "tool_choice", "tool_choice is only allowed with tools"
        if self.tools and self.response_format not in (None, {"type": "text"}):
            return "response_format", ("response_format and tools each constrain the answer; "
                                       "give one")
        if self.functions or self.function_call not in (None, "none"):
            return ("functions" if self.functions else "function_call",
                    "functions and function_call (function calling) are not supported")
        for i, message in enumerate(self.messages):
            if field := message.unsupported():
                return (f"messages[{i}].{field}", f"{field} in messages (the older function "
                        "calling) is not supported; send tool_calls")
        if self.modalities not in (None, ["text"]):
            return "modalities", 'modalities other than ["text"] are not supported'
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs needs logprobs, which are not supported"
        return super().unsupported()

class TokenizeRequest(_Body):
    """POST /tokenize: a prompt's ids as /v1/completions takes them (BOS where the tokenizer
    adds one), or a conversation's as /v1/chat/completions renders it; one of the two."""

    model: str
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text."""

    model: str
    tokens: list[int] = Field(min_length=1)
