"""Training EAGLE-3 heads (models/training/eagle3_head.py): the training-time-test unroll is the
runtime's chain, row for row, and a short training run writes a head that exports, raises the
held-out acceptance, and resumes from its checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import edgespec

torch = pytest.importorskip("torch")

from conftest import llama  # noqa: E402

from edgespec.export.eagle3 import Eagle3Head, HeadTensors, aux_features, read_head_config  # noqa: E402
from edgespec.models.training.eagle3_head import (  # noqa: E402
    Example,
    TrainableHead,
    TrainSettings,
    _shift,
    head_config,
    train_head,
    write_head,
)

SEQ = 14


@pytest.fixture(scope="module")
def target():
    return llama(200, 64, 4, seed=5, init=0.1)


@pytest.fixture(scope="module")
def trainable(target, tmp_path_factory):
    config = head_config(target.config, tmp_path_factory.mktemp("head"), draft_vocab=200)
    torch.manual_seed(0)
    head = TrainableHead(config, target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms off 1, so a swapped norm shows
    return head.eval()


def _inputs(target, config, seed=0):
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 200, SEQ))[None]
    return ids, aux_features(target, ids, config)


def _chain(reference, ids, aux, begin, steps):
    """The runtime's chain (Eagle3Drafter): true rows 0..begin in the cache, then rows
    begin+1..begin+steps each fed the row before's hidden_out. Returns the final hidden states
    (normed) of rows begin..begin+steps."""
    rows = torch.arange(begin + 1)
    logits, hidden, cache = reference(ids[:, 1 : begin + 2], aux[:, rows], rows[None])
    states = [reference.norm(hidden[:, -1])]
    for row in range(begin + 1, begin + steps + 1):
        logits, hidden, cache = reference(ids[:, row + 1 : row + 2], hidden[:, -1:],
                                          torch.tensor([[row]]), cache)
        states.append(reference.norm(hidden[:, -1]))
    return states


def test_unroll_step_s_is_the_runtime_chain_after_s_own_rows(target, trainable):
    """Row t at step s of the unroll equals the reference head run as the drafter runs it:
    true rows 0..t-s cached, then s chain rows. Wrong variants fail it: attending to every
    true row up to t (no chain start), or feeding the chain the row's own hidden state."""
    config = trainable.config
    ids, aux = _inputs(target, config)
    steps = 4
    outputs = trainable.unroll(ids, aux, steps)
    for begin in (0, 3, SEQ - 2 - steps):
        chain = _chain(trainable, ids, aux, begin, steps - 1)
        for s in range(steps):
            torch.testing.assert_close(outputs[s][:, begin + s], chain[s], atol=1e-5,
                                       rtol=1e-4)
    # the row computed as a true row (no chain: every row before it read target features)
    full = trainable(ids[:, 1:], aux[:, :-1], torch.arange(SEQ - 1)[None])  # every row true
    assert not torch.allclose(outputs[2][:, 7], trainable.norm(full[1][:, 7]), atol=1e-3)


def test_unroll_rejects_a_chain_that_forgets_its_own_rows(target, trainable, monkeypatch):
    """The same comparison with the unroll's chain keys dropped (each step attends only to
    the true rows before its chain) must fail: the test can tell."""
    import edgespec.models.training.eagle3_head as module

    config = trainable.config
    ids, aux = _inputs(target, config, seed=1)
    real = module._shift

    def drop_chain(x, by, dim=2):
        return real(x, by, dim) if dim == 1 else torch.zeros_like(x)

    monkeypatch.setattr(module, "_shift", drop_chain)
    outputs = trainable.unroll(ids, aux, 3)
    monkeypatch.setattr(module, "_shift", real)
    chain = _chain(trainable, ids, aux, 4, 2)
    torch.testing.assert_close(outputs[0][:, 4], chain[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outputs[2][:, 6], chain[2], atol=1e-3)


def test_shift_moves_rows_later():
    x = torch.arange(4.0).view(1, 1, 4, 1)
    assert _shift(x, 1).flatten().tolist() == [0.0, 0.0, 1.0, 2.0]
    assert _shift(x, 0) is x


def _examples(target, config, count, seed):
    """Texts the target wrote itself (greedy, from random two-token prompts) with its top-8."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(count):
        prompt = torch.from_numpy(rng.integers(0, 200, 2))[None]
        with torch.no_grad():
            ids = target.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=22, do_sample=False, pad_token_id=0)
            logp = torch.log_softmax(target(ids).logits[0].float(), -1)
        top_logp, top_ids = logp[1:-1].topk(8, -1)  # rows 1.. predict ids[2..]
        examples.append(Example(ids[0], 2, top_ids.to(torch.int32), top_logp.half(),
                                aux_features(target, ids, config)[0].half()))
    return examples


@pytest.mark.slow  # 56 texts generated, 30 + 6 optimizer steps: about a minute on 2 idle cores
def test_training_raises_acceptance_writes_a_head_and_resumes(target, tmp_path):
    """A run of 30 optimizer steps (no wall-clock budget: a busy machine takes longer, and
    does the same steps) on the target's own texts: held-out sum min(p, q) rises at every
    step, the head reads back in the published format (its reference equals the trained
    module), and a second run resumes from the saved state instead of starting again."""
    out = tmp_path / "head"
    token_ids = np.arange(0, 200, dtype=np.int32)
    config = head_config(target.config, out, len(token_ids))
    torch.manual_seed(0)
    head = TrainableHead(config, target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight)
    train = _examples(target, config, 48, seed=1)
    held = _examples(target, config, 8, seed=2)
    lines = []
    settings = TrainSettings(minutes=math.inf, lr=1e-2, batch=8, steps=3, max_steps=30)
    report = train_head(head, token_ids, train, held, settings, tmp_path / "state.pt",
                        lines.append)
    before, after = report["heldout_min_pq_before"], report["heldout_min_pq_after"]
    assert all(a > 1.5 * b for a, b in zip(after, before)), (before, after)
    write_head(out, head, token_ids, report)
    assert json.loads((out / "training_report.json").read_text())["steps"] == report["steps"]

    read = read_head_config(out, target.config)
    assert read.aux_layers == config.aux_layers and read.draft_vocab == 200
    reference = Eagle3Head.load(read, HeadTensors(read), target.model.embed_tokens.weight)
    ids, aux = _inputs(target, read)
    logits, _, _ = reference(ids[:, 1:], aux[:, :-1], torch.arange(SEQ - 1)[None])
    trained = head.lm_head(head.eval().unroll(ids, aux, 1)[0])
    torch.testing.assert_close(logits, trained, atol=1e-4, rtol=1e-4)

    resumed = []
    again = TrainableHead(config, target.model.embed_tokens.weight.detach())
    report2 = train_head(again, token_ids, train, held, TrainSettings(minutes=math.inf, lr=1e-2, max_steps=36),
                         tmp_path / "state.pt", resumed.append)
    assert resumed[0].startswith(f"train: resuming at step {report['steps']}")
    assert report2["steps"] == 36


def test_distill_refuses_bad_input_in_one_line_and_touches_nothing(checkpoints, tmp_path):
    from click.testing import CliRunner

    from edgespec.cli import main

    target = str(checkpoints["llama_target"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    result = CliRunner().invoke(main, ["distill", "--target", target, "--out", str(mine)])
    assert result.exit_code == 1 and "is not a head being distilled" in result.output
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "fresh"
    result = CliRunner().invoke(main, ["distill", "--target", target, "--out", str(fresh),
                                       "--prompts", "9999", "1", "1"])
    assert result.exit_code == 1 and "at most 680 72 128" in result.output
    assert not fresh.exists()
    result = CliRunner().invoke(main, ["distill", "--target", target, "--out", str(fresh),
                                       "--aux-layers", "1", "2", "1"])
    assert result.exit_code == 1 and "(1, 2, 1) repeat layer 1" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not fresh.exists()


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """A head trained (150 optimizer steps, no wall-clock budget) on the 8-word target's own greedy and sampled texts, exported
    beside it: a head that accepts, for the exactness checks of test_eagle3_decoding.py."""
    from transformers import AutoModelForCausalLM

    from edgespec.export import export_pair

    folder = checkpoints["words_target_fused"]
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    root = tmp_path_factory.mktemp("trained_head")
    vocab = target.config.vocab_size
    token_ids = np.arange(vocab, dtype=np.int32)
    config = head_config(target.config, root / "head", vocab, aux_layers=(0, 1, 1))  # 2 layers
    torch.manual_seed(0)
    head = TrainableHead(config, target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    texts = []
    for seed in range(96):  # the target's own texts, greedy and at T = 1, from short prompts
        torch.manual_seed(seed)
        prompt = torch.randint(0, vocab, (1, 1 + seed % 3))
        with torch.no_grad():
            ids = target.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  do_sample=seed % 2 == 1, max_new_tokens=24, top_k=0,
                                  pad_token_id=0)
            logp = torch.log_softmax(target(ids).logits[0].float(), -1)
        top_logp, top_ids = logp[:-1].topk(vocab, -1)  # row p predicts ids[p + 1]
        texts.append(Example(ids[0], 1, top_ids.to(torch.int32), top_logp.half(),
                             aux_features(target, ids, config)[0].half()))
    report = train_head(head, token_ids, texts[8:], texts[:8],
                        TrainSettings(minutes=math.inf, lr=1e-2, steps=3, max_steps=150),
                        root / "state.pt", lambda line: None)
    write_head(root / "head", head, token_ids, report)
    export_pair(folder, root / "head", root / "package")
    return edgespec.load(root / "package"), report


@pytest.mark.slow  # the fixture: 96 texts, 150 optimizer steps and an export (~80 s idle)
def test_a_trained_head_is_exact_greedy_and_sampled(trained):
    """Greedy output with the trained head is target-only output at fixed k = 1..4 (tokens
    drafted and accepted), and its first two sampled tokens at T = 1 follow the target's
    distribution (chi-square through the loop, k = 2); the head learned (held-out sum
    min(p, q) up at every step)."""
    from helpers import exact_two_token_distribution, two_token_samples
    from stats_check import ALPHA, fit_pvalue

    from edgespec.config import SamplingConfig

    pipe, report = trained
    assert all(a > b for a, b in zip(report["heldout_min_pq_after"],
                                     report["heldout_min_pq_before"]))
    drafted = accepted = 0
    for prompt in ("a b c", "g f e d", "b"):
        baseline = pipe.generate(prompt, max_new_tokens=30, drafter="none", ignore_eos=True)
        for k in range(1, 5):
            result = pipe.generate(prompt, max_new_tokens=30, draft_length=k,
                                   schedule="fixed", ignore_eos=True)
            assert result.token_ids == baseline.token_ids, (prompt, k)
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0 < accepted < drafted  # accepted and rejected rounds both ran
    t1 = SamplingConfig(temperature=1.0)
    samples, drafted, accepted = two_token_samples(pipe, t1, 2000, "a b c")
    assert drafted >= 2 * 2000 and accepted > 0
    assert fit_pvalue(samples, exact_two_token_distribution(pipe, t1, "a b c")) > ALPHA


@pytest.mark.slow  # the trained fixture, when this test is the first to ask for it
def test_the_trained_heads_check_rejects_a_loop_without_the_ratio(trained, monkeypatch):
    """The same chi-square with every proposal accepted (no min(1, p/q)) fails."""
    from helpers import exact_two_token_distribution, two_token_samples
    from stats_check import fit_pvalue

    from edgespec.config import SamplingConfig
    from edgespec.runtime import acceptance

    monkeypatch.setattr(acceptance, "accept_or_replace", lambda x, p, q, u: (True, x))
    pipe, _ = trained
    t1 = SamplingConfig(temperature=1.0)
    samples, _, _ = two_token_samples(pipe, t1, 1500, "a b c")
    assert fit_pvalue(samples, exact_two_token_distribution(pipe, t1, "a b c")) < 1e-6
