"""Chat through the package's template: Pipeline.chat, edgespec chat (piped), generate --chat,
bench's task prompts, and the sampling each surface says it uses."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from click.testing import CliRunner

import edgespec
from edgespec.bench import BUILT_IN_PROMPTS, bench_prompts, read_prompts
from edgespec.cli import main
from edgespec.config import describe_sampling
from edgespec.errors import EdgespecError, GenerationError
from edgespec.runtime.pipeline import Pipeline

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# exact settings: a fixed k that drafts (the pair's draft is a noisy copy of its target)
DRAFTED = {"drafter": "model", "draft_length": 2, "schedule": "fixed"}
DRAFTED_ARGS = ["--drafter", "model", "--draft-length", "2", "--schedule", "fixed"]


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def pipe(chatml_package):
    return edgespec.load(chatml_package)


@pytest.fixture(scope="module")
def plain_package(chatml_package, tmp_path_factory):
    """The chat package with its template taken out, as an export from a tokenizer without
    one writes it."""
    out = tmp_path_factory.mktemp("plain") / "package"
    shutil.copytree(chatml_package, out)
    (out / "chat_template.jinja").unlink()
    manifest = json.loads((out / "edgespec.json").read_text())
    (out / "edgespec.json").write_text(json.dumps({**manifest, "chat_template": None}))
    return out


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_encode_chat_writes_bos_once(pipe):
    """The template writes BOS; the text path (encode) adds the tokenizer's too, which typed
    by hand gives the doubled BOS of issue 28. encode_chat adds nothing."""
    bos, start = pipe.manifest.bos_token_id, pipe.tokenizer.token_to_id("<|im_start|>")
    text = pipe.chat_template.render(QUESTION)
    assert text.startswith("<|endoftext|><|im_start|>user\n")
    assert pipe.encode(text)[:3] == [bos, bos, start]  # what a hand-rendered prompt gets
    ids = pipe.encode_chat(QUESTION)
    rest = text.removeprefix("<|endoftext|>")
    assert ids == [bos, *pipe.tokenizer.encode(rest, add_special_tokens=False).ids]
    assert ids[:2] == [bos, start]


def test_chat_is_greedy_generation_from_the_rendered_ids(pipe):
    result = pipe.chat(QUESTION, max_new_tokens=16, **DRAFTED)
    baseline = pipe.generate(pipe.encode_chat(QUESTION), max_new_tokens=16, drafter="none")
    assert result.token_ids == baseline.token_ids and result.text == baseline.text
    assert result.stats.drafted > 0
    assert result.stats.healed == "" and result.stats.prompt_tokens == len(
        pipe.encode_chat(QUESTION))


def test_the_next_turn_starts_from_the_last_ones_caches(chatml_package, pipe):
    """Each turn's prompt is the last one, its reply and a new message: it reuses the kept
    caches at least as far as the last prompt (its reply retokenized may part sooner), and
    answers what a pipeline that keeps none answers."""
    fresh = edgespec.load(chatml_package, prefix_cache_slots=0)
    pipe.prefix_cache.clear()
    messages, last = [], []
    for turn, message in enumerate(["hello", "and then?", "why"]):
        messages.append(user(message))
        result = pipe.chat(messages, max_new_tokens=8, **DRAFTED)
        assert result.token_ids == fresh.chat(messages, max_new_tokens=8, **DRAFTED).token_ids
        assert result.stats.drafted > 0
        reused = result.stats.prompt_tokens_reused
        assert reused == 0 if turn == 0 else reused >= len(last)
        last = pipe.encode_chat(messages)
        messages.append(assistant(result.text))


def test_chat_stream_streams_the_same_text_and_can_be_cancelled(pipe):
    stream = pipe.chat_stream(QUESTION, max_new_tokens=12, drafter="none")
    assert "".join(stream) == pipe.chat(QUESTION, max_new_tokens=12, drafter="none").text

    stream = pipe.chat_stream(QUESTION, max_new_tokens=64, ignore_eos=True, drafter="none")
    pieces = iter(stream)
    first = next(pieces)
    stream.cancel()
    rest = list(pieces)
    assert stream.result.stats.finish_reason == "cancelled"
    assert stream.result.text == first + "".join(rest)
    assert len(stream.result.token_ids) < 64

    stream = pipe.chat_stream(QUESTION)
    stream.cancel()  # before the first round: nothing generated
    assert list(stream) == [] and stream.result.stats.finish_reason == "cancelled"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\] must be a dict with a 'role' and a 'content'"),
    ([user("hi"), "hi"], r"messages\[1\]"),
])
def test_chat_refuses_messages_that_are_not_a_conversation(pipe, messages, message):
    with pytest.raises(GenerationError, match=message):
        pipe.chat(messages)


def test_a_package_without_a_template_cannot_chat(plain_package):
    with pytest.raises(EdgespecError, match="has no chat template; use edgespec generate"):
        edgespec.load(plain_package).chat(QUESTION)


def test_chat_command_holds_the_conversation(chatml_package, pipe):
    """Piped: one message a line, one reply on stdout each; /stats, /reset, /exit; stderr
    says the sampling first."""
    settings = dict(max_new_tokens=8, **DRAFTED)
    first = pipe.chat([user("hello")], **settings).text
    second = pipe.chat([user("hello"), assistant(first), user("and then?")], **settings).text
    third = pipe.chat([user("hello"), assistant(first), user("and then?"), assistant(second),
                       user("why")], **settings).text
    result = run("chat", chatml_package, "-n", 8, *DRAFTED_ARGS, input=(
        "hello\nand then?\n/stats\nwhy\n\n/reset\nhello\n/help\n/nope\n/exit\nnot read\n"))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{first}\n{second}\n{third}\n{first}\n"
    lines = result.stderr.splitlines()
    assert lines[0] == ("sampling: greedy (the package sets no sampling defaults: edgespec's "
                        "fallback); --temperature 0.7 to sample")
    assert [line for line in lines if "tok/s" in line] == [
        line for line in lines if "acceptance" in line and "drafted by model" in line]
    assert len([line for line in lines if "tok/s" in line]) == 2  # /stats came before "why"
    # the third turn started from the second's kept caches
    assert "prompt tokens reused" in [line for line in lines if "tok/s" in line][0]
    assert "(the conversation is forgotten)" in lines
    assert any(line.split() == ["/reset", "forget", "the", "conversation", "so", "far"]
               for line in lines)
    assert "unknown command /nope; /help lists them" in lines
    assert ">>>" not in result.output


def test_chat_command_says_the_packages_sampling(chatml_package, tmp_path):
    package = tmp_path / "sampled"
    shutil.copytree(chatml_package, package)
    manifest = json.loads((package / "edgespec.json").read_text())
    manifest["generation"] = {"temperature": 0.7, "top_p": 0.9}
    (package / "edgespec.json").write_text(json.dumps(manifest))
    result = run("chat", package, input="")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        "sampling: temperature 0.7, top-p 0.9 (the package's defaults)")
    result = run("chat", package, "-t", 0, input="")
    assert result.stderr.splitlines()[0] == (
        "sampling: greedy (as given; the rest the package's defaults)")


def test_ctrl_c_stops_a_reply_and_not_the_session(chatml_package, pipe, monkeypatch):
    """Ctrl-C after the first piece of the first reply: that reply ends (cancelled) and
    stays in the history as far as it went; the next message is answered after it."""
    chat_stream = Pipeline.chat_stream
    handler = signal.getsignal(signal.SIGINT)  # what Ctrl-C ran before: put back after
    calls = []

    class CtrlCAfterFirstPiece:  # presses Ctrl-C: calls what SIGINT would run now
        def __init__(self, inner):
            self.inner, self.pieces = inner, []

        def cancel(self):
            self.inner.cancel()

        def __iter__(self):
            for piece in self.inner:
                self.pieces.append(piece)
                yield piece
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

        @property
        def result(self):
            return self.inner.result

    def interrupted(self, *args, **kwargs):
        stream = chat_stream(self, *args, **kwargs)
        calls.append(CtrlCAfterFirstPiece(stream) if not calls else stream)
        return calls[-1]

    monkeypatch.setattr(Pipeline, "chat_stream", interrupted)
    result = run("chat", chatml_package, "-n", 40, "--drafter", "none",
                 input="hello\nand then?\n")
    assert result.exit_code == 0, result.output
    partial = "".join(calls[0].pieces)
    assert calls[0].result.stats.finish_reason == "cancelled"
    assert len(calls[0].result.token_ids) < 40
    assert "(reply stopped; what it said stays in the history)" in result.stderr
    monkeypatch.setattr(Pipeline, "chat_stream", chat_stream)
    second = pipe.chat([user("hello"), assistant(partial), user("and then?")],
                       max_new_tokens=40, drafter="none").text
    assert result.stdout == f"{partial}\n{second}\n"
    assert signal.getsignal(signal.SIGINT) is handler  # put back


def test_chat_drops_the_oldest_turns_when_the_window_fills(chat_package):
    """The test pair's window is 128 tokens: a few turns of 40-token replies outgrow it. It is
    said once; a message that alone fills the window is refused, and the session goes on."""
    result = run("chat", chat_package, "-n", 40, "--drafter", "none",
                 input="hello there\n" * 5 + "x " * 200 + "\nhello\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("outgrew the context window of 128 tokens") == 1
    assert "error: this message takes" in result.stderr and "write less" in result.stderr


def test_chat_without_a_template_is_one_line_and_exit_1(plain_package):
    result = run("chat", plain_package, input="hello\n")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {plain_package} has no chat template; use edgespec generate for plain text, "
        "or re-export from a checkpoint whose tokenizer has one"]
    result = run("chat", input="hello\n")  # the demo pair: a code model, no template
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert "demo pair is a code model without a chat template" in result.stderr
    result = run("generate", plain_package, "hello", "--chat")
    assert result.exit_code == 1 and "has no chat template" in result.stderr


def test_generate_chat_answers_one_message(chatml_package, pipe):
    question = QUESTION[0]["content"]
    result = run("generate", chatml_package, question, "--chat", "-n", 12, *DRAFTED_ARGS)
    assert result.exit_code == 0, result.output
    expected = pipe.chat(QUESTION, max_new_tokens=12, **DRAFTED)
    assert result.stdout == expected.text + "\n"
    assert result.stderr.splitlines()[-1].endswith(
        "; sampling: greedy (the package sets no sampling defaults: edgespec's fallback)")
    out = json.loads(run("generate", chatml_package, question, "--chat", "-n", 12,
                         "--system", "Be brief.", "--json").stdout)
    system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert out["token_ids"] == pipe.chat(system, max_new_tokens=12).token_ids
    assert out["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                               "repetition_penalty": 1.0, "presence_penalty": 0.0,
                               "frequency_penalty": 0.0}
    assert run("generate", chatml_package, "hi", "--system", "x").exit_code == 1


def test_bench_runs_a_chat_package_on_the_task_prompts(chatml_package):
    result = run("bench", chatml_package, "-n", 2, "--repeats", 1, "--temperature", 0,
                 "--draft-length", 2, "--schedule", "fixed")
    assert result.exit_code == 0, result.output
    assert "(12 prompts x 1 repeats" in result.stderr
    assert "prompts: edgespec's task prompts, through the chat template" in result.stderr
    assert "speedup" in result.stdout


def test_bench_without_prompts_or_template_is_refused(plain_package):
    result = run("bench", plain_package, "-n", 2)
    assert result.exit_code == 1
    assert "has no prompts.jsonl and no chat template" in result.stderr


def test_bench_prompts_render_conversations_through_the_template(pipe, plain_package, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"messages": QUESTION}) + "\n" + json.dumps("def f(x):") + "\n")
    assert read_prompts(path) == [QUESTION, "def f(x):"]
    prompts, where = bench_prompts(pipe, path)
    assert prompts == [pipe.encode_chat(QUESTION), "def f(x):"] and where == str(path)
    with pytest.raises(EdgespecError, match="holds chat messages but .* has no chat template"):
        bench_prompts(edgespec.load(plain_package), path)
    kinds = [json.loads(line)["kind"] for line in BUILT_IN_PROMPTS.read_text().splitlines()]
    assert sorted(set(kinds)) == ["code", "question", "summarize"] and len(kinds) == 12


@pytest.mark.parametrize("given, package, said", [
    ({}, {}, "greedy (the package sets no sampling defaults: edgespec's fallback)"),
    ({"temperature": None}, {"temperature": 0.7, "top_k": 50},
     "temperature 0.7, top-k 50 (the package's defaults)"),
    ({"temperature": 0.8}, {}, "temperature 0.8 (as given)"),
    ({"top_p": 0.5}, {"temperature": 1.0}, "temperature 1, top-p 0.5 (as given; the rest the "
                                           "package's defaults)"),
    ({"min_p": 0.05, "repetition_penalty": 1.1}, {}, "greedy, repetition penalty 1.1 (as "
                                                      "given)"),
    ({"temperature": 0.7, "min_p": 0.05, "frequency_penalty": 0.5}, {},
     "temperature 0.7, min-p 0.05, frequency penalty 0.5 (as given)"),
])
def test_describe_sampling_says_what_and_where_from(given, package, said):
    assert describe_sampling(given, package) == said


def test_the_library_falls_back_to_greedy(pipe):
    assert pipe.manifest.generation == {} and pipe.default_sampling.greedy


def test_no_runtime_module_imports_the_server():
    """The template engine, the bounded child and the one encoding rule are the runtime's: no
    module under runtime/ (nor the package's top-level modules) imports edgespec.serve, even
    lazily inside a function, which a run-time check of sys.modules would miss."""
    import ast
    from pathlib import Path

    root = Path(edgespec.__file__).parent
    offenders = []
    for path in [*(root / "runtime").glob("*.py"), *root.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("edgespec.serve")]
    assert offenders == []


def test_encode_text_is_the_one_encoding_rule(pipe):
    """Plain text: the tokenizer's ids without its own special tokens, BOS first where the
    package adds one; a rendered template: none added (it writes its own). The bounded child
    runs this rule for Pipeline.encode and the server's /tokenize alike (test_serve_guards
    compares the two)."""
    from dataclasses import replace

    from edgespec.runtime.inputs import encode_text

    plain = pipe.tokenizer.encode("def add", add_special_tokens=False).ids
    adds = replace(pipe.manifest, add_bos_token=True, bos_token_id=1)
    assert encode_text(pipe.tokenizer, adds, "def add") == [1, *plain]
    assert encode_text(pipe.tokenizer, adds, "def add", rendered=True) == plain
    assert pipe.encode("def add") == pipe.manifest.with_bos(plain)
