"""Text from strangers: a package's chat template and tokenizer, and bytes typed at `edgespec
chat`, made hostile by hand. The server already rendered and tokenized in a bounded child
(test_serve_guards.py, test_serve_hostile.py); these are the other surfaces: the library
(``Pipeline.encode``, ``encode_chat``, ``chat``), ``edgespec generate`` and ``edgespec chat``,
the compile at start-up, and distilling's rendering. Each fault is one line naming it (an
EdgespecError, exit 1 from the CLI, no traceback) within bounded time and memory. Each case
says what happened to it before.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner
from serve_helpers import child_running, wait_until, with_normalizer, with_template

import edgespec
from edgespec.cli import main
from edgespec.models import demo_package
from edgespec.errors import ChatTemplateError, TokenizerError
from edgespec.runtime import bounded_text
from edgespec.runtime.chat_template import ChatTemplate

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="the child's memory limit and /proc are Linux's")
HI = [{"role": "user", "content": "hi"}]
LOOPING = ("{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}"
           "{% endfor %}{% endfor %}{% endfor %}")  # 10**12 rounds: days
HUGE = "{{ 'x'|center(1500000000) }}"
# onig backtracks on every run of a's: a run of 26 before a non-b passes its retry limit (a
# Rust panic); runs of 20 take ~0.04 s each, half a minute for this prompt
BACKTRACKING = {"type": "Replace", "pattern": {"Regex": "(a+)+b"}, "content": "b"}
SLOW_PROMPT = ("a" * 20 + " ") * 700
PANIC_PROMPT = "a" * 26 + "c"


def run(*args, input: str | bytes | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_error_line(stderr: str, match: str) -> str:
    """The one line of stderr that holds ``match``; no traceback anywhere."""
    assert "Traceback" not in stderr and "panicked" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if match in line]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def short_deadline(monkeypatch):
    """Renders and tokenizing on the library's path given 1 s, not LIBRARY_TIMEOUT_S."""
    monkeypatch.setattr(bounded_text, "LIBRARY_TIMEOUT_S", 1.0)


@pytest.fixture(scope="module")
def backtracking(tmp_path_factory) -> Path:
    return with_normalizer(demo_package(), tmp_path_factory.mktemp("tok") / "demo", BACKTRACKING)


# -- templates ---------------------------------------------------------------------------------

def test_compiling_a_template_runs_none_of_it():
    """Before: Jinja folded the constant expression while compiling, building the 100 MB
    string in the compiling process (1500000000: 6.3 GB in `edgespec chat` and in the server
    at start-up, before any child could bound it)."""
    tracemalloc.start()
    try:
        # a literal width: 10**8 is an operation the sandbox intercepts, never folded
        template = ChatTemplate("a{{ 'x'|center(100000000) }}{{ 1 + 2 }}", {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20
    assert ChatTemplate("a{{ 'x'|center(3) }}{{ 1 + 2 }}", {}).render(HI) == "a x 3"
    assert template.name == "chat template"


def test_the_server_starts_without_running_its_template(chat_package, tmp_path):
    """Before: build_app compiled the template in the server's process, folding the constant
    (a 100 MB string here, built four times over; 6.3 GB for center(1500000000)) at start-up,
    outside the child's bounds."""
    pytest.importorskip("starlette")
    from edgespec.serve.app import build_app

    pipe = edgespec.load(with_template(chat_package, tmp_path / "pkg",
                                       "{{ 'x'|center(100000000) }}"))
    tracemalloc.start()
    try:
        build_app(pipe)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20


@LINUX
@pytest.mark.parametrize("source, match", [(LOOPING, "took more than 1 s"),
                                           (HUGE, "ran out of memory")])
def test_the_library_renders_a_hostile_template_within_bounds(chat_package, tmp_path, source,
                                                               match, short_deadline):
    """Before: encode_chat and chat looped for hours (LOOPING) or built 6.3 GB in the caller's
    process, twice (HUGE: once compiling, once rendering)."""
    pipe = edgespec.load(with_template(chat_package, tmp_path / "pkg", source))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB
    start = time.monotonic()
    for call in (pipe.encode_chat, pipe.chat):
        with pytest.raises(ChatTemplateError, match=match) as caught:
            call(HI)
        assert "chat_template.jinja" in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 500_000
    assert pipe.generate("hi", max_new_tokens=2).token_ids  # the child comes back for text


@LINUX
def test_edgespec_chat_and_generate_say_a_looping_template_in_one_line(chat_package, tmp_path,
                                                                       short_deadline):
    """Before: both hung in the render, Ctrl-C the only way out."""
    pkg = with_template(chat_package, tmp_path / "pkg", LOOPING)
    result = run("chat", pkg, input="hi\nhello\n")
    assert result.exit_code == 0  # the session goes on: each message is said refused
    refused = [line for line in result.stderr.splitlines() if "took more than 1 s" in line]
    assert len(refused) == 2 and "Traceback" not in result.stderr
    result = run("generate", pkg, "hi", "--chat", "-n", 2)
    assert result.exit_code == 1
    one_error_line(result.stderr, "chat_template.jinja (or the tokenizer on its text) took")


def test_a_templates_escape_sequences_are_shown_escaped(chat_package, tmp_path):
    """Before: raise_exception's message reached the terminal raw (here: red text and a
    cleared screen); a multi-line one was many lines."""
    pkg = with_template(chat_package, tmp_path / "pkg",
                        "{{ raise_exception('\\x1b[31mno\\x1b[2J\\nsecond line') }}")
    with pytest.raises(ChatTemplateError) as caught:
        edgespec.load(pkg).encode_chat(HI)
    message = str(caught.value)
    assert "\x1b" not in message and "\n" not in message and "\\x1b[31mno" in message
    result = run("chat", pkg, input="hi\n")
    assert result.exit_code == 0 and "\x1b" not in result.stderr
    one_error_line(result.stderr, "refused the messages")


def test_distilling_renders_the_checkpoints_template_as_transformers_does_within_bounds(
        chat_package, monkeypatch):
    """Before: the teacher's answer (models/training/teacher.py) called apply_chat_template,
    whose Jinja folds constants while compiling (HUGE: 6.3 GB in the training process) and has
    no deadline (LOOPING)."""
    from transformers import PreTrainedTokenizerFast

    from edgespec.models.training.teacher import chat_ids

    monkeypatch.setattr(bounded_text, "LIBRARY_TIMEOUT_S", 1.0)
    manifest = json.loads((chat_package / "edgespec.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(chat_package / "tokenizer.json"),
        chat_template=(chat_package / "chat_template.jinja").read_text(),
        **{k: v for k, v in manifest["special_tokens"].items() if isinstance(v, str)})
    conversations = [HI, [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "def add(a, b):"}]]
    assert chat_ids(tokenizer, conversations) == [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        for c in conversations]
    if sys.platform.startswith("linux"):
        for source, match in ((LOOPING, "took more than 1 s"), (HUGE, "ran out of memory")):
            tokenizer.chat_template = source
            with pytest.raises(ChatTemplateError, match=match):
                chat_ids(tokenizer, conversations)


# -- tokenizers --------------------------------------------------------------------------------

def test_a_tokenizer_panic_is_one_line(backtracking):
    """Before: a Rust panic's message and a PanicException traceback (not an EdgespecError)."""
    with pytest.raises(TokenizerError, match="the tokenizer failed \\(PanicException"):
        edgespec.load(backtracking).encode(PANIC_PROMPT)
    result = subprocess.run([sys.executable, "-m", "edgespec", "generate", str(backtracking),
                             PANIC_PROMPT, "-n", "2"], capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert result.returncode == 1
    one_error_line(result.stderr, "the tokenizer failed")


@LINUX
def test_a_backtracking_tokenizer_stops_at_its_deadline(backtracking, short_deadline):
    """Before: generate spent half a minute in the tokenizer (95 s on a 44 KB prompt)."""
    pipe = edgespec.load(backtracking)
    start = time.monotonic()
    with pytest.raises(TokenizerError, match="took more than 1 s"):
        pipe.generate(SLOW_PROMPT, max_new_tokens=2)
    assert time.monotonic() - start < 5
    assert pipe.generate("def f():", max_new_tokens=2).token_ids  # a new child


@LINUX
@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_ends_edgespec_generate_while_the_tokenizer_is_busy(backtracking, signum, code,
                                                                    said):
    """Before: the tokenizer held the GIL in Rust, so SIGINT and SIGTERM waited for it (half a
    minute here, 95 s on a 44 KB prompt)."""
    process = subprocess.Popen([sys.executable, "-m", "edgespec", "generate", str(backtracking),
                                SLOW_PROMPT, "-n", "2"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=_env(),
                               preexec_fn=_as_at_a_terminal)
    try:
        wait_until(lambda: child_running(process.pid), "tokenizing in the child", 60)
        process.send_signal(signum)
        start = time.monotonic()
        _, stderr = process.communicate(timeout=10)
        assert time.monotonic() - start < 3
    finally:
        process.kill()
        process.wait()
    assert process.returncode == code
    assert stderr.strip().splitlines()[-1] == said and "Traceback" not in stderr


@LINUX
def test_ctrl_c_stops_a_render_in_edgespec_chat_and_the_session_goes_on(chat_package, tmp_path):
    """Before: the render ran in the session's process, and Ctrl-C there ended the whole
    session (exit 130, "interrupted"), unlike Ctrl-C during a reply. Now it ends the render's
    child, the message is left out, and the next line is read."""
    pkg = with_template(chat_package, tmp_path / "pkg", LOOPING)
    process = subprocess.Popen([sys.executable, "-m", "edgespec", "chat", str(pkg)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=_env(),
                               preexec_fn=_as_at_a_terminal)
    try:
        process.stdin.write("hi\n")
        process.stdin.flush()
        wait_until(lambda: child_running(process.pid), "rendering in the child", 60)
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, stderr = process.communicate("/bye\n", timeout=10)
        assert time.monotonic() - start < 3
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, stderr
    assert "(stopped before the reply" in stderr and "Traceback" not in stderr


def test_one_pipeline_tokenizes_for_threads_that_come_and_go():
    """The bounded child outlives the thread that first asked (Linux ends a child with the
    thread that started it): before its own starting thread, every other request here failed
    with 'the tokenizer stopped its process'."""
    from concurrent.futures import ThreadPoolExecutor

    pipe = edgespec.load(demo_package())
    texts = ["def f(x):" * (1 + i % 5) for i in range(16)]
    want = [pipe.manifest.with_bos(pipe.tokenizer.encode(t, add_special_tokens=False).ids)
            for t in texts]
    for text, ids in zip(texts, want):  # each in a thread that ends after it
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(pipe.encode, text).result(timeout=30) == ids
    with ThreadPoolExecutor(8) as pool:  # and many at once
        assert list(pool.map(pipe.encode, texts, timeout=30)) == want


def test_the_bounded_child_needs_no_serve_extra(chat_package):
    """The library's bounded child is the server's, but neither it nor the parent's side may
    import the serve extra (Starlette, pydantic), nor anything of edgespec.serve: the library
    runs without it (the child and the template engine are runtime/'s)."""
    code = ("import sys, edgespec; pipe = edgespec.load(sys.argv[1]); "
            "pipe.encode('hi'); pipe.encode_chat([{'role': 'user', 'content': 'hi'}]); "
            "print(sorted(m for m in ('starlette', 'pydantic', 'uvicorn', 'edgespec.serve') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(chat_package)], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _as_at_a_terminal() -> None:
    """SIGINT as a terminal gives it (Python then raises KeyboardInterrupt): a shell that ran
    the test suite in the background (``cmd &`` without job control) ignores it, and its
    children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(edgespec.__file__).parents[1])}


# -- typed text --------------------------------------------------------------------------------

def test_edgespec_chat_takes_bytes_that_are_not_utf8(chat_package):
    """Before: a byte that is not UTF-8 (Latin-1's é, a stray 0xff) ended the session with a
    UnicodeDecodeError traceback."""
    result = run("chat", chat_package, "-n", 3, "--drafter", "none",
                 input=b"caf\xe9 \xff\nhello\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.stderr and "error" not in result.stderr
    assert len(result.stdout.splitlines()) == 2  # both messages answered
