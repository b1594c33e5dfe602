"""Token healing through real onnxruntime sessions: the first generated token regrows the
prompt's last one from the target's restricted row, exactly as target-only decoding draws it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import PROMPTS, texts_by_schedule
from reference import process_logits
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.cli import main
from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.errors import ConfigError
from edgespec.models import demo_package
from edgespec.runtime import speculative, text
from edgespec.runtime.drafters import make_drafter
from edgespec.runtime.healing import PrefixIndex, token_texts
from edgespec.runtime.sampling import process_row
from edgespec.runtime.schedule import FixedSchedule
from edgespec.runtime.stats import GenerationStats

# Prompts ending where a token rarely ends: "):", a space, a newline, an open bracket
HEAL_PROMPTS = [
    "def add(a, b):",
    "The quick brown ",
    "for i in range(10):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x",
    "import numpy as np\nx = np.zeros((",
]


@pytest.fixture(scope="module")
def pipes(packages):
    return {name: edgespec.load(packages[name]) for name in ("llama", "gpt2", "llama_noisy")}


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


def brute_force(texts: list[str | None], prefix: str) -> np.ndarray:
    return np.array([i for i, t in enumerate(texts) if t and t.startswith(prefix)], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# The index


@pytest.mark.parametrize("name", ["llama", "demo"])
def test_the_index_equals_a_scan_of_the_vocabulary(pipes, demo, name):
    pipe = demo if name == "demo" else pipes[name]
    texts = token_texts(pipe.tokenizer, pipe.special_ids)
    index = pipe.prefix_index
    prefixes = sorted({t[:n] for t in texts if t for n in range(1, len(t) + 1)})
    rng = np.random.default_rng(0)
    prefixes = [*map(str, rng.choice(prefixes, 400)),
                "", "zzzz", "\U0010ffff", " \n", "):", "é", "\ufffd"]
    for prefix in prefixes:
        assert np.array_equal(index.extending(prefix), brute_force(texts, prefix)), prefix
    assert all(texts[i] is None for i in pipe.special_ids)
    print(f"\n{name}: {len(texts)} tokens, index built in {pipe.prefix_index_s * 1e3:.1f} ms")


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.one_of(st.none(), st.text(alphabet="ab\n é\U0010ffff", max_size=4))),
       prefix=st.text(alphabet="ab\n é\U0010ffff", max_size=3))
def test_the_index_equals_a_scan_on_any_strings(texts, prefix):
    assert np.array_equal(PrefixIndex(texts).extending(prefix), brute_force(texts, prefix))


def test_the_index_of_a_large_vocabulary_answers_as_a_scan():
    """151,643 random texts (Qwen2's vocabulary size). Its speed is measured by
    benchmarks, not asserted here."""
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz_ (){}:\n.,é"))
    texts = ["".join(rng.choice(alphabet, rng.integers(1, 9))) for _ in range(151_643)]
    index = PrefixIndex(texts)
    for prefix in ("a", "ab", "é", "\n."):
        assert np.array_equal(index.extending(prefix), brute_force(texts, prefix))


# ---------------------------------------------------------------------------------------------
# Exactness: healing is the same constrained target step with or without drafting


@pytest.mark.parametrize("pair", ["llama", "gpt2", "llama_noisy"])
def test_greedy_speculative_equals_target_only_with_healing(pipes, pair):
    pipe = pipes[pair]
    healed = 0
    for prompt in HEAL_PROMPTS + PROMPTS:
        baseline = pipe.generate(prompt, max_new_tokens=32, drafter="none")
        healed += bool(baseline.stats.healed)
        runs = {f"k={k}": dict(draft_length=k, schedule="fixed") for k in (1, 3, 6)}
        runs["adaptive"] = dict(draft_length=6, schedule="adaptive")
        runs["ngram"] = dict(draft_length=4, drafter="ngram", schedule="fixed")
        for name, setting in runs.items():
            result = pipe.generate(prompt, max_new_tokens=32, **setting)
            assert result.token_ids == baseline.token_ids, (prompt, name)
            assert result.text == baseline.text
            assert result.stats.healed == baseline.stats.healed
            assert sum(result.stats.draft_lengths.values()) == result.stats.target_calls
    assert healed >= 3  # the prompts that end mid-merge were healed


def test_greedy_identity_on_the_demo_with_healing(demo):
    healed = 0
    for prompt in ["def fibonacci(n):", "def quicksort(items):", "for i in range(10):\n", "x = "]:
        baseline = demo.generate(prompt, max_new_tokens=24, drafter="none")
        healed += bool(baseline.stats.healed)
        for setting in (dict(draft_length=3, schedule="fixed"), dict(draft_length=8),
                        dict(drafter="ngram")):
            assert demo.generate(prompt, max_new_tokens=24, **setting).token_ids == (
                baseline.token_ids), (prompt, setting)
    assert healed >= 2


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_a_seed_gives_the_same_text_whatever_the_draft_lengths_with_healing(pipes, setting):
    pipe = pipes["llama_noisy"]
    healed = [p for p in HEAL_PROMPTS if pipe.heal(p, pipe.encode(p))]
    assert len(healed) >= 2
    for seed, prompt in enumerate(healed[:3]):
        settings_ = dict(max_new_tokens=32, seed=seed, ignore_eos=True, **setting)
        texts = texts_by_schedule(pipe, prompt, **settings_)
        assert all(t == texts["k=1"] for t in texts.values()), (prompt, seed, texts)
        # the healed position is drawn from the target alone with u[0]: target-only draws the
        # same first token from the same seed (later positions differ: no draft to test there)
        alone = pipe.generate(prompt, drafter="none", **settings_)
        assert alone.token_ids[0] == texts["k=1"][0]


def test_the_first_token_regrows_the_removed_text(pipes, demo):
    for pipe in (pipes["llama"], pipes["gpt2"], demo):
        for prompt in HEAL_PROMPTS:
            ids = pipe.encode(prompt)
            healing = pipe.heal(prompt, ids)
            if healing is None:
                continue
            for seed in range(3):
                result = pipe.generate(prompt, max_new_tokens=12, temperature=1.0, seed=seed,
                                       ignore_eos=True)
                first = result.token_ids[0]
                assert first in healing.allowed
                whole = pipe.tokenizer.decode([*healing.context, *result.token_ids])
                generated = whole[len(pipe.tokenizer.decode(healing.context)) :]
                assert generated.startswith(healing.removed)
                assert result.text == generated[len(healing.removed) :]
                assert result.stats.healed == healing.removed
                assert result.stats.prompt_tokens == len(ids) - 1
                assert result.stats.new_tokens == len(result.token_ids) == 12


# ---------------------------------------------------------------------------------------------
# The first token's distribution: the target's row restricted to the allowed set, renormalised

PROMPT = "The quick brown "  # ends on a lone space: every token starting with one is allowed
SETTINGS = {
    "T=1": SamplingConfig(temperature=1.0),
    "top-k 5": SamplingConfig(temperature=0.5, top_k=5),
    "top-p 0.6": SamplingConfig(temperature=0.5, top_p=0.6),
}


def exact_first_token(pipe, sampling: SamplingConfig) -> dict:
    healing = pipe.heal(PROMPT, pipe.encode(PROMPT))
    logits = pipe.target.forward(np.array(healing.prompt), pipe.target.new_cache())[-1]  # [V]
    masked = np.full_like(logits, -np.inf)
    masked[healing.allowed] = logits[healing.allowed]
    probs = process_logits(masked[None], sampling)[0]  # the dense reference
    return {t: p for t, p in enumerate(probs) if p > 0}


def first_tokens(pipe, sampling: SamplingConfig, n: int, **settings_) -> list[int]:
    return [pipe.generate(PROMPT, max_new_tokens=1, seed=seed, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p, **settings_).token_ids[0]
            for seed in range(n)]


@pytest.mark.parametrize("setting, drafter",
                         [("T=1", "auto"), ("T=1", "none"), ("top-k 5", "auto"),
                          ("top-p 0.6", "auto")])
def test_the_first_token_follows_the_restricted_target_distribution(pipes, setting, drafter):
    pipe, sampling = pipes["llama_noisy"], SETTINGS[setting]
    expected = exact_first_token(pipe, sampling)
    assert len(expected) > 1 and max(expected.values()) < 0.9
    samples = first_tokens(pipe, sampling, 2000, drafter=drafter, draft_length=2, schedule="fixed")
    assert fit_pvalue(samples, expected) > ALPHA


def unconstrained(target, committed, allowed, sampling, uniforms, stats, penalties=None):
    """Wrong: the allowed set ignored (the first token drawn from the whole row)."""
    p = process_row(target.run(committed)[-1], sampling)
    return p.draw(uniforms.rows(len(committed), 1)[0, 0])


def not_renormalised(target, committed, allowed, sampling, uniforms, stats,
                     penalties=None):
    """Wrong: drawn from the whole row, and a token outside the set replaced by the removed one
    (the prompt left as it was): allowed tokens keep p(x), the removed one gets the rest."""
    token = unconstrained(target, committed, allowed, sampling, uniforms, stats)
    return token if token in allowed else REMOVED[0]


REMOVED: list[int] = []


@pytest.mark.parametrize("wrong", [unconstrained, not_renormalised])
def test_the_distribution_check_rejects_a_wrong_healing_step(pipes, monkeypatch, wrong):
    pipe, sampling = pipes["llama_noisy"], SETTINGS["T=1"]
    REMOVED[:] = [pipe.encode(PROMPT)[-1]]
    monkeypatch.setattr(speculative, "constrained_step", wrong)
    # the text check would refuse a first token that does not regrow the removed text
    monkeypatch.setattr(text, "Unprefix", lambda prefix: lambda piece: piece)
    samples = first_tokens(pipe, sampling, 2000, draft_length=2, schedule="fixed")
    assert fit_pvalue(samples, exact_first_token(pipe, sampling)) < 1e-6


# ---------------------------------------------------------------------------------------------
# When healing does not apply, and turning it off


def test_healing_off_is_the_loop_without_a_constrained_step(pipes):
    """token_healing=False: the full prompt decoded as before healing existed."""
    pipe = pipes["llama_noisy"]
    for prompt in HEAL_PROMPTS:
        ids = pipe.encode(prompt)
        config = GenerationConfig(max_new_tokens=24, draft_length=3, schedule="fixed")
        stats = GenerationStats(speculative=True)
        drafter = make_drafter(config, pipe.draft, stats,
                               speculative.request_positions(len(ids), config))
        direct = [t for new in speculative.decode(
            pipe.target, drafter, ids, config, FixedSchedule(3), pipe.manifest.max_positions,
            set(pipe.manifest.eos_token_ids), stats) for t in new]
        off = pipe.generate(prompt, config, token_healing=False)
        assert off.token_ids == direct
        assert off.stats.healed == "" and off.stats.prompt_tokens == len(ids)
        assert off.text == pipe.tokenizer.decode(direct)
        assert pipe.generate(ids, config).token_ids == direct  # ids are never healed


def test_a_one_token_prompt_is_not_healed(pipes):
    pipe = pipes["llama"]
    prompt = next(t for t in ("a", "x", "(") if len(pipe.encode(t)) == 1)
    result = pipe.generate(prompt, max_new_tokens=8)
    assert result.stats.healed == ""
    assert result.token_ids == pipe.generate(prompt, max_new_tokens=8,
                                             token_healing=False).token_ids


def test_a_last_token_nothing_extends_is_not_healed_and_costs_no_step(pipes):
    pipe = pipes["llama"]
    texts = token_texts(pipe.tokenizer, pipe.special_ids)
    index = pipe.prefix_index
    prompt = next(
        p for i, t in enumerate(texts)
        if t and t.isascii() and len(index.extending(t)) == 1
        for p in ("x = " + t,) if pipe.encode(p)[-1] == i
    )
    assert pipe.heal(prompt, pipe.encode(prompt)) is None
    on = pipe.generate(prompt, max_new_tokens=8, draft_length=2, schedule="fixed")
    off = pipe.generate(prompt, max_new_tokens=8, draft_length=2, schedule="fixed",
                        token_healing=False)
    assert on.stats.healed == "" and on.token_ids == off.token_ids
    assert on.stats.target_calls == off.stats.target_calls


def test_healing_costs_one_target_step_and_no_prefill_of_its_own(pipes):
    pipe = pipes["llama_noisy"]
    on = pipe.generate("The quick brown ", max_new_tokens=1, draft_length=3, schedule="fixed")
    assert on.stats.healed == " " and on.stats.target_calls == 1 and on.stats.drafted == 0
    assert on.stats.draft_lengths == {0: 1}


def test_token_healing_is_validated_and_a_cli_flag(pipes, packages):
    with pytest.raises(ConfigError, match="token_healing must be True or False"):
        GenerationConfig(token_healing="yes")
    runs = {}
    for flag in ("--token-healing", "--no-token-healing"):
        out = CliRunner().invoke(main, ["generate", str(packages["llama"]), "The quick brown ",
                                        "-n", "6", "--schedule", "fixed", "--json", flag])
        assert out.exit_code == 0, out.output
        runs[flag] = json.loads(out.stdout)
    assert runs["--token-healing"]["stats"]["healed"] == " "
    assert runs["--no-token-healing"]["stats"]["healed"] == ""
    assert runs["--no-token-healing"]["token_ids"] == pipes["llama"].generate(
        "The quick brown ", max_new_tokens=6, token_healing=False).token_ids


def test_the_server_takes_token_healing_for_text_prompts(demo):
    from starlette.testclient import TestClient

    from edgespec.serve import build_app

    prompt = "for i in range(10):\n"  # ends on a newline token, which longer ones extend
    with TestClient(build_app(demo), base_url="http://localhost") as client:  # a loopback Host
        for healing in (True, False):
            out = client.post("/v1/completions", json={
                "model": "demo", "prompt": prompt, "temperature": 0, "max_tokens": 12,
                "token_healing": healing}).json()
            expected = demo.generate(prompt, max_new_tokens=12, token_healing=healing)
            assert out["choices"][0]["text"] == expected.text
            assert out["edgespec"]["healed"] == expected.stats.healed
            assert bool(expected.stats.healed) == healing
