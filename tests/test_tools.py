"""Tool calls through the server (runtime/tools.py): the openai package's whole loop (a call,
the tool's result, the final answer) against the app, with a package whose chat template
writes Qwen2.5's ``<tool_call>`` blocks; the calls are constrained to the tools' parameter
schemas, identical with and without drafting, and streamed as OpenAI streams them. A template
with no tool format refuses tools with a 400 that says so."""

from __future__ import annotations

import json

import pytest
from serve_helpers import with_template

import edgespec
from edgespec.runtime import tools
from edgespec.runtime.grammar import GrammarTokenizer

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

HERMES = (
    "{%- if tools %}<|system|>You may call these functions:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}Answer with <tool_call></tool_call> blocks.\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}\n"
    "{%- elif message.role == 'tool' %}<|tool|>{{ message.content }}\n"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}\n{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                  "maximum": 14}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_package(tmp_path_factory):
    """A tiny Llama pair with a 1,024-position window (tools' schemas fill a prompt), its
    target's template HERMES."""
    from conftest import _hf_tokenizer, _save, _train_bpe, llama
    from serve_helpers import with_chat_template

    from edgespec.export import export_pair

    root = tmp_path_factory.mktemp("tools")
    bpe = _hf_tokenizer(_train_bpe(400))
    target = _save(llama(len(bpe), 64, 2, seed=1, positions=1024), bpe, root / "target")
    draft = _save(llama(len(bpe), 32, 1, seed=2, positions=1024), bpe, root / "draft")
    export_pair(with_chat_template(target, root / "chat_target"), draft, root / "chat",
                validation="skip")
    return with_template(root / "chat", root / "pkg", HERMES)


@pytest.fixture(scope="module")
def served(tool_package):
    from starlette.testclient import TestClient

    from edgespec.serve.app import build_app

    pipe = edgespec.load(tool_package, calibration_cache=False)
    with TestClient(build_app(pipe), base_url="http://localhost") as http:
        yield pipe, openai.OpenAI(base_url="http://localhost/v1", api_key="x",
                                  http_client=http, max_retries=0)


def test_the_openai_tool_loop_call_result_answer(served):
    """tool_choice required: a call whose arguments fit the schema, finish_reason
    tool_calls; the call and its result sent back render through the template, and the final
    answer (tool_choice none) is text with no call in it."""
    pipe, client = served
    first = client.chat.completions.create(model="pkg", messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert len(arguments["city"]) <= 10 and call.id.startswith("call_")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
    final = client.chat.completions.create(model="pkg", messages=history, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=30)
    assert final.choices[0].message.tool_calls is None
    assert "<tool_call>" not in final.choices[0].message.content


def test_a_named_tool_is_the_one_called_and_drafting_changes_no_token(served):
    """tool_choice naming get_time among two tools, one call: that tool, an integer zone in its
    range; the server's
    answer is the library's constrained generation of the same ids, target-only and drafted
    (tokens drafted), token for token."""
    pipe, client = served
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model="pkg", messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=named, parallel_tool_calls=False,
                                            temperature=0, max_tokens=150)
    assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0]
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["zone"], int)
    form = tools.Hermes()
    constraint = form.constraint("required", tools.read_tools([TIME]), False)
    ids = pipe.bounded_text.render(ASK, [WEATHER, TIME])
    alone = pipe.generate(ids, max_new_tokens=150, constraint=constraint, drafter="none")
    drafted = pipe.generate(ids, max_new_tokens=150, constraint=constraint, draft_length=3,
                            schedule="fixed")
    assert drafted.token_ids == alone.token_ids and drafted.stats.drafted > 0
    assert form.parse(alone.text)[1][0].arguments == call.function.arguments


def test_tool_calls_stream_as_openai_deltas(served):
    pipe, client = served
    stream = client.chat.completions.create(model="pkg", messages=ASK, tools=[WEATHER],
                                            tool_choice="required", temperature=0,
                                            max_tokens=120, stream=True)
    calls, finish, content = {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            calls.setdefault(part.index, {"name": "", "arguments": ""})
            calls[part.index]["name"] += part.function.name or ""
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["unit"]


def test_auto_answers_text_or_a_constrained_call(served):
    """tool_choice auto: each sampled answer is text with no call, or text then calls that
    parse with the schema's fields (a started call is constrained)."""
    pipe, client = served
    for seed in range(4):
        answer = client.chat.completions.create(model="pkg", messages=ASK, tools=[WEATHER],
                                                temperature=1.0, seed=seed, max_tokens=150)
        message = answer.choices[0].message
        if message.tool_calls:
            assert set(json.loads(message.tool_calls[0].function.arguments)) == {"city",
                                                                                  "unit"}
        elif answer.choices[0].finish_reason == "stop":
            assert "<tool_call>" not in message.content


def test_tools_are_refused_where_they_cannot_be(chat_package, served):
    """A template with no tool format, a malformed tool, an unknown named tool, calls in
    history whose arguments are no JSON object: each a 400 naming the field."""
    from starlette.testclient import TestClient

    from edgespec.serve.app import build_app

    plain = edgespec.load(chat_package, calibration_cache=False)
    with TestClient(build_app(plain), base_url="http://localhost") as http:
        body = {"model": plain.path.name, "messages": ASK, "tools": [WEATHER]}
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "no tool format" in refused.text
    _, client = served
    cases = [({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}}, "nope"),
             ({"tools": [WEATHER], "messages": [*ASK, {"role": "assistant", "tool_calls": [
                 {"id": "1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": "[1]"}}]}]},
              "JSON object arguments")]
    for extra, said in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": "pkg", "messages": ASK, **extra})
        assert said in str(error.value)


def test_the_parsers_read_both_formats():
    content, calls = tools.Hermes().parse(
        'Let me look. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert content == "Let me look." and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": 1}
    assert tools.Hermes().parse("<tool_call>\n{\"name\": \"f\"")[1] == []  # cut: text
    assert tools.Llama3().parse('{"name": "f", "parameters": {"a": "b"}}')[1][0].name == "f"
    assert tools.Llama3().parse("It is sunny.") == ("It is sunny.", [])
    assert tools.tool_format(HERMES).name == "hermes"
    assert tools.tool_format("{{ messages }}") is None


@pytest.mark.parametrize("form", [tools.Hermes(), tools.Llama3()], ids=["hermes", "llama3"])
def test_every_tool_choice_compiles_and_holds_its_calls(served, form):
    """Each mode's grammar compiles; a call the format writes fits "required", text with no
    call fits "none" and "auto", and a call naming another tool fits none of them."""
    pipe, _ = served
    offered = tools.read_tools([WEATHER])
    call = {"name": "get_weather", form.arguments_key: {"city": "Oslo", "unit": "celsius"}}
    wrong = {**call, "name": "get_time"}
    if form.name == "hermes":
        def write(c): return f"<tool_call>\n{json.dumps(c)}\n</tool_call>"
    else:
        def write(c): return json.dumps(c)
    tokenizer: GrammarTokenizer = pipe.grammar_tokenizer

    def fits(mode: str, text: str) -> bool:
        grammar = tokenizer.compile(form.constraint(mode, offered, False))
        ids = pipe.tokenizer.encode(text, add_special_tokens=False).ids
        matcher = grammar.matcher
        return matcher.validate_tokens(ids) == len(ids) and (
            matcher.consume_tokens(ids) and matcher.is_accepting())

    assert fits("required", write(call)) and not fits("required", write(wrong))
    assert fits("auto", write(call)) and not fits("auto", write(wrong))
    assert fits("none", "It is sunny.") and fits("auto", "It is sunny.")
    assert not fits("none", write(call))
