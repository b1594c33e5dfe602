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


def test_generate_help_states_the_adaptive_schedules_largest_k():
    """The help's "up to" is config.ADAPTIVE_MAX_K, the bound the pipeline applies."""
    from edgespec.config import ADAPTIVE_MAX_K

    text = " ".join(run("generate", "--help").output.split())
    assert f"the most (adaptive, up to {ADAPTIVE_MAX_K})." in text


def test_serve_help_states_the_ray_defaults():
    """--replica-cpus, the autoscaler's delays and --drain-timeout show serve/config.py's
    constants, which serve/ray_deploy.py's RayOptions and Autoscale default to (read there
    without importing ray)."""
    import re

    from edgespec.serve import config

    text = " ".join(run("serve", "--help").output.split())
    for option, value in (("replica-cpus", config.REPLICA_CPUS),
                          ("upscale-delay", config.UPSCALE_DELAY_S),
                          ("downscale-delay", config.DOWNSCALE_DELAY_S),
                          ("drain-timeout", config.DRAIN_S)):
        shown = re.search(rf"--{option} FLOAT RANGE .*?\[default: ([^;\]]*)", text)
        assert shown and float(shown[1]) == value, (option, shown and shown[1])
    assert f"aiming at {config.TARGET_ONGOING:g} ongoing request per replica" in text


def test_generate_streams_the_same_text_as_the_api(packages):
    pkg = packages["llama_noisy"]
    result = run("generate", pkg, "def add(a, b):", "-n", 30, "--draft-length", 3)
    assert result.exit_code == 0, result.output
    expected = edgespec.load(pkg).generate("def add(a, b):", max_new_tokens=30, draft_length=3).text
    assert result.stdout == expected + "\n"
    assert "tok/s" in result.stderr and "acceptance" in result.stderr


def test_generate_json_holds_text_and_stats(packages):
    args = ["generate", packages["llama_noisy"], "x =", "-n", 12, "-t", 0.8, "--seed", 3, "--json"]
    first, second = run(*args), run(*args)
    out = json.loads(first.stdout)
    assert out["text"] == json.loads(second.stdout)["text"]
    expected = edgespec.load(packages["llama_noisy"]).generate("x =", max_new_tokens=12,
                                                              temperature=0.8, seed=3)
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert out["stats"]["new_tokens"] == len(out["token_ids"])
    assert {"acceptance_rate", "per_position_acceptance", "tokens_per_s", "draft_s"} <= set(out["stats"])


def test_generate_says_where_the_models_ran(packages):
    result = run("generate", packages["llama"], "x", "-n", 4)
    assert "target on CPU, draft on CPU" in result.stderr.splitlines()[-1]
    out = json.loads(run("generate", packages["llama"], "x", "-n", 4, "--json").stdout)
    assert out["providers"] == {"target": "CPUExecutionProvider", "draft": "CPUExecutionProvider"}


def test_bench_reports_progress_on_stderr(packages, tmp_path, monkeypatch):
    from edgespec.cli import bench as bench_command

    monkeypatch.setattr(bench_command._ProgressLines, "EVERY", 0.0)  # a line after every prompt
    result = run("bench", packages["llama"], "--prompts", prompts_file(tmp_path), "-n", 4,
                 "--draft-length", 2, "--temperature", 0, "--repeats", 1)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"benchmarking {packages['llama']}: 3 generations of 4 tokens")
    assert any(line.strip().startswith("3/3 generations") for line in lines)


def test_bench_reads_the_packages_own_prompts_by_default():
    """The demo package carries prompts.jsonl: a plain `edgespec bench` needs no --prompts."""
    result = run("bench", "-n", 2, "--draft-length", 1, "--temperature", 0, "--repeats", 1)
    assert result.exit_code == 0, result.output
    assert "fixed" in result.stdout and "adaptive" in result.stdout


def test_drafter_none_decodes_with_the_target_alone(packages):
    out = json.loads(run("generate", packages["llama"], "x", "-n", 8, "--drafter", "none",
                         "--json").stdout)
    assert out["stats"]["speculative"] is False and out["stats"]["drafted"] == 0


def test_the_former_flags_are_gone(packages):
    """--gamma and --no-draft had no release behind them: --draft-length and --drafter none."""
    for flag in (["--gamma", "3"], ["--no-draft"]):
        result = run("generate", packages["llama"], "x =", "-n", 8, *flag)
        assert result.exit_code == 2 and "No such option" in result.stderr
    assert "--draft-length" in run("generate", "--help").output


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


def edited_package(packages, tmp_path, **fields):
    """A copy of the gpt2 package with manifest fields replaced ("target_path" for target.path)."""
    import shutil

    pkg = tmp_path / "edited"
    shutil.copytree(packages["gpt2"], pkg)
    raw = json.loads((pkg / "edgespec.json").read_text())
    for name, value in fields.items():
        if name == "tokenizer_file":
            (pkg / "tokenizer.json").write_text(value)
        elif "_path" in name:
            raw[name.split("_")[0]]["path"] = value
        else:
            raw[name] = value
    (pkg / "edgespec.json").write_text(json.dumps(raw))
    return pkg


def prompts_file(tmp_path, text="def f(x):\n", name="prompts.txt", encoding="utf-8"):
    path = tmp_path / name
    path.write_bytes(text.encode(encoding))
    return path


def bench(packages, tmp_path, *args):
    """A bench small enough to finish quickly if nothing stops it."""
    return ["bench", packages["gpt2"], "--draft-length", "1", "--temperature", "0", "-n", "2",
            "--repeats", "1", *args]


BAD_INPUTS = {
    "missing folder": (lambda p, t: ["generate", t / "nope", "hi"], "is not a folder"),
    "not a package": (lambda p, t: ["generate", t, "hi"], "has no edgespec.json"),
    "corrupt manifest": (lambda p, t: ["generate", corrupt_package(p, t), "hi"], "is corrupt"),
    "negative temperature": (lambda p, t: ["generate", p["gpt2"], "hi", "-t", -1], "temperature must be a finite number >= 0"),
    "top_p zero": (lambda p, t: ["generate", p["gpt2"], "hi", "--top-p", 0], "top_p must be a number in (0, 1]"),
    "top_p above one": (lambda p, t: ["generate", p["gpt2"], "hi", "--top-p", 1.5], "top_p must be a number in (0, 1]"),
    "min_p above one": (lambda p, t: ["generate", p["gpt2"], "hi", "--min-p", 1.5], "min_p must be a number in [0, 1]"),
    "repetition penalty zero": (lambda p, t: ["generate", p["gpt2"], "hi", "--repetition-penalty", 0], "repetition_penalty must be a finite number > 0"),
    "presence penalty past 2": (lambda p, t: ["generate", p["gpt2"], "hi", "--presence-penalty", 3], "presence_penalty must be a number in [-2, 2]"),
    "draft length zero": (lambda p, t: ["generate", p["gpt2"], "hi", "--draft-length", 0], "--draft-length must be an integer in 1..64"),
    "draft length far too large": (lambda p, t: ["generate", p["gpt2"], "hi", "-k", 100000], "--draft-length must be an integer in 1..64"),
    "negative seed": (lambda p, t: ["generate", p["gpt2"], "hi", "--seed", -1], "seed must be None or an integer >= 0"),
    "prompt not UTF-8": (lambda p, t: ["generate", p["gpt2"], "\udcff"], "not valid UTF-8"),
    "manifest field of the wrong type": (
        lambda p, t: ["generate", edited_package(p, t, max_positions="512"), "hi"], "max_positions must be"),
    "model path outside the package": (
        lambda p, t: ["generate", edited_package(p, t, target_path="../x.onnx"), "hi"],
        "target.path must be a path inside the package"),
    "corrupt tokenizer": (
        lambda p, t: ["generate", edited_package(p, t, tokenizer_file="{"), "hi"], "cannot read"),
    "bench with an empty prompts file": (
        lambda p, t: bench(p, t, "--prompts", prompts_file(t, "\n \n")), "holds no prompts"),
    "bench with a prompts file that is not UTF-8": (
        lambda p, t: bench(p, t, "--prompts", prompts_file(t, "café\n", encoding="latin-1")),
        "is not UTF-8"),
    "bench --json into a missing folder": (
        lambda p, t: bench(p, t, "--prompts", prompts_file(t), "--json", t / "no" / "r.json"),
        "does not exist"),
    "bench --json onto a folder": (
        lambda p, t: bench(p, t, "--prompts", prompts_file(t), "--json", t), "is a folder"),
    "bench -n 0": (lambda p, t: bench(p, t, "--prompts", prompts_file(t), "-n", 0),
                   "max_new_tokens must be an integer >= 1"),
    "bench draft length far too large": (
        lambda p, t: ["bench", p["gpt2"], "--draft-length", "2,1000"], "--draft-length must be an integer in 1..64"),
    "build-demo with a negative seed": (
        lambda p, t: ["models", "build-demo", "--out", t / "demo", "--seed", -1], "seed must be >= 0"),
    "prompt too long": (lambda p, t: ["generate", p["gpt2"], "x " * 300], "shorten the prompt"),
    "a package and no prompt": (lambda p, t: ["generate", p["gpt2"]],
                                "is a folder and no prompt was given"),
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


def test_click_option_errors_stay_click_usage_errors(packages):
    for args in (["-n", "abc"], ["--seed", "x"], ["--provider", "gpu"]):
        result = run("generate", packages["gpt2"], "hi", *args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
        assert result.stderr.splitlines()[-1].startswith("Error: Invalid value for")
        assert "Traceback" not in result.output


def test_an_internal_fault_is_not_dressed_as_bad_input(packages, monkeypatch):
    def crop_past_the_end(*args, **kwargs):
        raise ValueError("cannot crop a KV cache of length 3 to 5")

    monkeypatch.setattr("edgespec.runtime.pipeline.decode", crop_past_the_end)
    result = run("generate", packages["gpt2"], "hi", "-n", 4)
    assert isinstance(result.exception, ValueError)  # a bug: the traceback is shown
    assert "Error: cannot crop" not in result.stderr


def test_a_real_process_refuses_a_prompt_that_is_not_utf8(packages):
    proc = subprocess.run(
        [sys.executable, "-m", "edgespec", "generate", str(packages["gpt2"]).encode(), b"\xff"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: the prompt is not valid UTF-8") and proc.stderr.count("\n") == 1


def test_a_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "edgespec", "generate", str(tmp_path), "hi", "--top-p", "2"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr == "Error: top_p must be a number in (0, 1], got 2.0\n"


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


def test_the_command_line_starts_without_the_heavy_imports():
    """Ctrl-C is handled from the CLI's first lines: onnxruntime, numpy and torch load later,
    while signals wait (an import interrupted half-way can crash the interpreter)."""
    code = ("import sys, edgespec, edgespec.cli; "
            "print(sorted(m for m in ('onnxruntime', 'numpy', 'torch', 'tokenizers') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]"


def test_build_demo_help_states_the_recipes_own_defaults():
    """The budgets' defaults are RecipeConfig's, not a copy that drifts from it."""
    from edgespec.models.training.config import RecipeConfig

    result = run("models", "build-demo", "--help")
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    config = RecipeConfig()
    assert f"Target training budget. [default: {config.target_minutes}]" in text
    assert f"Draft distillation budget. [default: {config.draft_minutes}]" in text


def test_distill_help_states_the_aux_layers_rule():
    from edgespec.export.aux_layers import RULE

    text = " ".join(run("distill", "--help").output.split())
    assert f"[default: {RULE}]" in text
