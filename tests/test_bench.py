"""The benchmark: the expected-speedup formula, and a short run through real sessions."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest
from click.testing import CliRunner

import edgespec
from edgespec.runtime.speculative import Round
from edgespec.bench import (
    QUICK,
    BenchConfig,
    BenchInterrupted,
    expected_speedup,
    format_table,
    read_prompts,
    run_bench,
)
from edgespec.cli import main
from edgespec.runtime.stats import GenerationStats


def test_expected_speedup_is_leviathans_formula():
    # alpha 0.8, k 4: (1 - 0.8^5) / 0.2 = 3.3616 tokens for 4 * 0.5 + 12 ms, against 10 ms/token
    assert expected_speedup(0.8, 4, draft_ms=0.5, verify_ms=12, step_ms=10) == pytest.approx(
        3.3616 * 10 / 14)
    assert expected_speedup(1.0, 1, 0.5, 10, 10) == pytest.approx(2 * 10 / 10.5)
    assert expected_speedup(0.0, 1, 0.5, 10, 10) == pytest.approx(10 / 10.5)
    # sampled: a fully accepted round (alpha^k of them) runs the draft once more
    assert expected_speedup(1.0, 1, 0.5, 10, 10, sampled=True) == pytest.approx(2 * 10 / 11)
    assert expected_speedup(0.0, 1, 0.5, 10, 10, sampled=True) == pytest.approx(10 / 10.5)


def test_alpha_counts_only_the_draft_tokens_verification_looked_at():
    stats = GenerationStats(speculative=True)
    for n_accepted in (4, 1):  # 4 accepted; 1 accepted, 1 rejected, 2 never looked at
        stats.record_round(Round([0] * (n_accepted + 1), drafted=4, accepted=n_accepted,
                                 sources=("model",) * 4), "model")
    assert stats.acceptance_rate == 5 / 8
    assert stats.alpha == 5 / 6
    assert stats.per_position_acceptance == [1.0, 0.5, 0.5, 0.5]


def test_a_short_bench_reports_every_configuration(packages):
    pipe = edgespec.load(packages["llama_noisy"])
    config = BenchConfig(draft_lengths=(1, 3), temperatures=(0.0, 1.0), max_new_tokens=16,
                         repeats=2, schedules=("fixed", "heuristic"), drafters=("model",))
    calls = []
    report = run_bench(pipe, ["def add(a, b):", "The quick"], config, progress=calls.append)
    assert calls[-1] == 2 * 2 * 2 * 4
    assert [(r.temperature, r.schedule, r.draft_length) for r in report.rows] == [
        (0, "heuristic", 3), (0, "fixed", 1), (0, "fixed", 3),
        (1, "heuristic", 3), (1, "fixed", 1), (1, "fixed", 3),
    ]
    for row in report.rows:
        assert row.runs == 4 and row.speedup > 0
        if row.schedule == "fixed":
            assert len(row.per_position_acceptance) == row.draft_length
            assert row.efficiency == pytest.approx(row.speedup / row.expected_speedup)
        else:
            assert row.expected_speedup is None
    assert all(r.target_step_ms > 0 and r.verify_ms > 0 for r in report.rows)


def test_bench_command_writes_json(packages, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def f(x):"\n{"prompt": "import os"}\n')
    assert read_prompts(prompts) == ["def f(x):", "import os"]
    out = tmp_path / "bench.json"
    args = ["bench", str(packages["llama_noisy"]), "--prompts", str(prompts), "--draft-length",
            "2", "--temperature", "0", "-n", "8", "--repeats", "1", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "speedup" in result.stdout and "expected" in result.stdout
    report = json.loads(out.read_text())
    assert report["rows"][0]["draft_length"] == 2
    # what the ratios were measured on travels with them
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["onnxruntime"].startswith("onnxruntime")
    assert {"cpu", "caches", "load_average_at_start", "memory_bytes"} <= set(machine)
    assert report["sessions"]["target"]["threads"] >= 0
    # the command as given, not the argv of the process that ran it (pytest's here)
    assert report["command"] == shlex.join(["edgespec", *args])
    assert "machine: " in result.output and "sessions: target" in result.output


def test_bench_help_states_the_configs_defaults():
    """The options' defaults are BenchConfig's, not copies that drift from it."""
    help_text = CliRunner().invoke(main, ["bench", "--help"]).output
    chunks = {chunk.split()[0]: " ".join(chunk.split())  # each option's own lines
              for chunk in re.split(r"\n\s+(?:-n, )?--", help_text)[1:]}
    config = BenchConfig()
    for option, value in (("draft-length", config.draft_lengths),
                          ("temperature", config.temperatures),
                          ("schedule", config.schedules), ("drafter", config.drafters),
                          ("max-new-tokens", config.max_new_tokens),
                          ("repeats", config.repeats)):
        shown = re.search(r"\[default: ([^]]*)\]", chunks[option])
        assert shown, option
        if isinstance(value, tuple):  # comma-separated, each read as the config's type
            read = tuple(type(v)(x) for v, x in zip(value, shown[1].replace(" ", "").split(",")))
            assert read == value and shown[1].count(",") == len(value) - 1, (option, shown[1])
        else:
            assert shown[1] == str(value), (option, shown[1])


def test_bench_refuses_bad_lists(packages):
    result = CliRunner().invoke(main, ["bench", str(packages["gpt2"]), "--draft-length", "0,2"])
    assert result.exit_code == 1 and "--draft-length must be an integer in 1..64" in result.stderr


def test_plot_without_matplotlib_is_refused_before_benchmarking(packages, tmp_path, monkeypatch):
    def no_benchmarking(*args, **kwargs):
        raise AssertionError("benchmarked before checking --plot")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setattr("edgespec.bench.run_bench", no_benchmarking)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    result = CliRunner().invoke(main, [
        "bench", str(packages["gpt2"]), "--prompts", str(prompts), "--plot", str(tmp_path / "s.png"),
    ])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr == "Error: --plot needs matplotlib: pip install 'edgespec[bench]'\n"


def test_an_output_without_write_permission_is_refused(tmp_path, monkeypatch):
    from edgespec.bench import check_writable
    from edgespec.errors import EdgespecError

    check_writable(tmp_path / "r.json", "--json")  # fine
    monkeypatch.setattr("edgespec.bench.os.access", lambda path, mode: False)
    with pytest.raises(EdgespecError, match="--json .*r.json: no permission to write"):
        check_writable(tmp_path / "r.json", "--json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_folder_is_refused(tmp_path):
    from edgespec.bench import check_writable
    from edgespec.errors import EdgespecError

    tmp_path.chmod(0o500)
    try:
        with pytest.raises(EdgespecError, match="no permission to write"):
            check_writable(tmp_path / "r.json", "--json")
    finally:
        tmp_path.chmod(0o700)


def test_run_bench_refuses_an_empty_prompt_list(packages):
    from edgespec.errors import EdgespecError

    with pytest.raises(EdgespecError, match="no prompts"):
        run_bench(edgespec.load(packages["gpt2"]), [], BenchConfig(draft_lengths=(1,), repeats=1))


def test_read_prompts_refuses_prompts_that_are_not_strings(tmp_path):
    from edgespec.errors import EdgespecError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": 5}\n')
    with pytest.raises(EdgespecError, match="not JSON Lines of prompts"):
        read_prompts(path)


def test_a_prompt_with_a_json_schema_is_benched_under_it_with_and_without_drafting(
        packages, tmp_path, monkeypatch):
    from edgespec.bench import ConstrainedPrompt, bench_prompts
    from edgespec.errors import EdgespecError

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x = ", "json_schema": schema}) + "\n"
                    + json.dumps("def add(a, b):") + "\n")
    pipe = edgespec.load(packages["llama"])
    prompts, _ = bench_prompts(pipe, path)
    assert isinstance(prompts[0], ConstrainedPrompt) and prompts[1] == "def add(a, b):"
    seen, generate = [], pipe.generate

    def recording(prompt, config=None, **settings):
        result = generate(prompt, config, **settings)
        constraint = settings.get("constraint", getattr(config, "constraint", None))
        seen.append((prompt, constraint is not None, result.text, result.stats.drafted))
        return result

    monkeypatch.setattr(pipe, "generate", recording)
    run_bench(pipe, prompts, BenchConfig(draft_lengths=(2,), temperatures=(0.0,),
                                         max_new_tokens=8, repeats=1))
    held = [(c, text, drafted) for prompt, c, text, drafted in seen if prompt == "x = "]
    assert held and all(c for c, _, _ in held)  # warm-up, target-only and speculative: all held
    assert all(c is False for prompt, c, _, _ in seen if prompt == "def add(a, b):")
    drafted = [d for _, _, d in held]
    assert 0 in drafted and max(drafted) > 0  # target-only and drafted runs, both held
    assert len({text for _, text, _ in held}) == 1  # greedy: drafted answers the undrafted one
    path.write_text(json.dumps({"prompt": "x", "json_schema": 5}) + "\n")
    with pytest.raises(EdgespecError, match="line 1: its json_schema is not one"):
        read_prompts(path)


def test_bench_compares_drafters_and_refuses_one_the_package_lacks(packages, checkpoints, tmp_path):
    pipe = edgespec.load(packages["llama_noisy"])
    config = BenchConfig(draft_lengths=(2,), temperatures=(0.0,), max_new_tokens=12, repeats=1,
                         schedules=("fixed", "adaptive"), drafters=("model", "ngram"))
    report = run_bench(pipe, ["a b a b a b", "def add(a, b):"], config)
    assert [(r.drafter, r.schedule) for r in report.rows] == [
        ("model", "adaptive"), ("model", "fixed"), ("ngram", "adaptive"), ("ngram", "fixed")]
    assert report.rows[1].expected_speedup and report.rows[3].expected_speedup is None
    with pytest.raises(edgespec.EdgespecError, match="drafters must be among auto, model, ngram"):
        BenchConfig(drafters=("lookup",))

    from edgespec.export import export_pair

    export_pair(checkpoints["llama_target"], None, tmp_path / "alone", validation="skip")
    result = CliRunner().invoke(main, ["bench", str(tmp_path / "alone"), "--drafter", "model",
                                       "--draft-length", "2", "--temperature", "0", "-n", "4",
                                       "--repeats", "1"])
    assert result.exit_code == 1
    assert "needs a draft model and this package is target only" in result.output


def test_ctrl_c_keeps_the_rows_measured_so_far(packages):
    """Interrupted in its second temperature, the bench still hands over the first one's rows
    and those of the second's finished prompts, and its table says it was cut short."""
    pipe = edgespec.load(packages["llama_noisy"])
    config = BenchConfig(draft_lengths=(2,), temperatures=(0.0, 1.0), max_new_tokens=8, repeats=1,
                         schedules=("fixed",))

    def progress(done: int) -> None:
        if done == 3 * 2:  # two prompts at T = 0, then one at T = 1
            raise KeyboardInterrupt

    with pytest.raises(BenchInterrupted) as caught:
        run_bench(pipe, ["def add(a, b):", "The quick"], config, progress=progress)
    report = caught.value.report
    assert isinstance(caught.value, KeyboardInterrupt)  # the CLI still exits as Ctrl-C does
    assert [(r.temperature, r.runs) for r in report.rows] == [(0.0, 2), (1.0, 1)]
    assert report.interrupted == 6
    assert "interrupted after 6 generations" in format_table(report)


def test_quick_bench_runs_few_short_generations(packages, tmp_path):
    """--quick: QUICK's settings and the first QUICK_PROMPTS prompts, where no option says
    otherwise (-n here)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"def f{i}(x):" for i in range(9)) + "\n")
    result = CliRunner().invoke(main, ["bench", str(packages["llama_noisy"]), "--quick",
                                       "--prompts", str(prompts), "-n", "6"])
    assert result.exit_code == 0, result.output
    runs = 4 * (1 + len(QUICK.variants))  # per prompt: target-only and each variant
    assert f"{runs} generations of 6 tokens (4 prompts x 1 repeats x 1 temperatures" \
        in result.stderr
    assert [line.split()[2] for line in result.stdout.splitlines()
            if line.strip().startswith("0 ")] == ["adaptive", "fixed"]


def test_the_bench_command_prints_the_partial_table_on_ctrl_c(packages, monkeypatch, tmp_path):
    from edgespec import bench as benchmark

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")

    def interrupted(pipe, prompts, config, **kwargs):
        raise BenchInterrupted(benchmark.BenchReport(config, prompts=len(prompts),
                                                     interrupted=0))

    monkeypatch.setattr(benchmark, "run_bench", interrupted)
    result = CliRunner().invoke(main, ["bench", str(packages["llama_noisy"]), "--quick",
                                       "--prompts", str(prompts)])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "interrupted after 0 generations" in result.stdout
