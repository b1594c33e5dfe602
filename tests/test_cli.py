"""The command line: help, a generate round-trip, and bad input as one line with exit code 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import edgespec
from edgespec.cli import main


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("command", [[], ["export"], ["generate"]])
def test_help(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "Usage: main" in result.output or "Usage:" in result.output


def test_generate_streams_the_same_text_as_the_api(packages):
    pkg = packages["llama_noisy"]
    result = run("generate", pkg, "def add(a, b):", "-n", 30, "--gamma", 3)
    assert result.exit_code == 0, result.output
    expected = edgespec.load(pkg).generate("def add(a, b):", max_new_tokens=30, gamma=3).text
    assert result.stdout == expected + "\n"
    assert "tok/s" in result.stderr and "acceptance" in result.stderr


def test_generate_json_holds_text_and_stats(packages):
    args = ["generate", packages["llama_noisy"], "x =", "-n", 12, "-t", 0.8, "--seed", 3, "--json"]
    first, second = run(*args), run(*args)
    out = json.loads(first.stdout)
    assert out["text"] == json.loads(second.stdout)["text"]
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) <= 12
    assert {"acceptance_rate", "per_position_acceptance", "tokens_per_s", "draft_s"} <= set(out["stats"])


def test_no_draft_decodes_with_the_target_alone(packages):
    out = json.loads(run("generate", packages["llama"], "x", "-n", 8, "--no-draft", "--json").stdout)
    assert out["stats"]["speculative"] is False and out["stats"]["drafted"] == 0


def test_export_command_writes_a_package(checkpoints, tmp_path):
    out = tmp_path / "pkg"
    result = run("export", "--target", checkpoints["gpt2_target"], "--draft",
                 checkpoints["gpt2_draft"], "--out", out)
    assert result.exit_code == 0, result.output
    assert "[4/4] done" in result.stderr and (out / "edgespec.json").is_file()


def corrupt_package(packages, tmp_path):
    import shutil

    pkg = tmp_path / "corrupt"
    shutil.copytree(packages["gpt2"], pkg)
    (pkg / "edgespec.json").write_text('{"format_version": 1, "target": ')
    return pkg


BAD_INPUTS = {
    "missing folder": (lambda p, t: ["generate", t / "nope", "hi"], "is not a folder"),
    "not a package": (lambda p, t: ["generate", t, "hi"], "has no edgespec.json"),
    "corrupt manifest": (lambda p, t: ["generate", corrupt_package(p, t), "hi"], "is corrupt"),
    "negative temperature": (lambda p, t: ["generate", p["gpt2"], "hi", "-t", -1], "temperature must be >= 0"),
    "top_p zero": (lambda p, t: ["generate", p["gpt2"], "hi", "--top-p", 0], "top_p must be in (0, 1]"),
    "top_p above one": (lambda p, t: ["generate", p["gpt2"], "hi", "--top-p", 1.5], "top_p must be in (0, 1]"),
    "gamma zero": (lambda p, t: ["generate", p["gpt2"], "hi", "--gamma", 0], "gamma must be >= 1"),
    "prompt too long": (lambda p, t: ["generate", p["gpt2"], "x " * 300], "shorten the prompt"),
    "export of a folder without a model": (
        lambda p, t: ["export", "--target", t, "--draft", t, "--out", t / "o"], "has no config.json"),
    "export of a non-causal model": (
        lambda p, t: ["export", "--target", bert(t), "--draft", bert(t), "--out", t / "o"],
        "not a causal language model"),
}


def bert(tmp_path):
    from transformers import BertConfig

    BertConfig(architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_code_1(packages, tmp_path, case):
    make_args, message = BAD_INPUTS[case]
    result = run(*make_args(packages, tmp_path))
    assert result.exit_code == 1
    error = result.stderr.splitlines()[-1]  # progress lines may come first
    assert error.startswith("Error: ") and message in error
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_a_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "edgespec", "generate", str(tmp_path), "hi", "--top-p", "2"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr == "Error: top_p must be in (0, 1], got 2.0\n"


def test_an_unavailable_provider_falls_back_to_cpu_with_one_warning(packages):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here; the fallback is what this test checks")
    result = run("generate", packages["gpt2"], "hi", "-n", 4, "--provider", "cuda")
    assert result.exit_code == 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "running on CPU" in warnings[0]
    with pytest.warns(UserWarning, match="running on CPU"):
        pipe = edgespec.load(packages["gpt2"], provider="cuda")
    assert pipe.target.providers == ["CPUExecutionProvider"]
