"""Decoding with an EAGLE-3 head through real onnxruntime sessions: the head's rows line up with
the PyTorch reference, greedy output is the target's, and sampled output follows the target's
distribution (fixed k, tokens drafted).

A head's proposals depend on where a round began (drafters.py), so the "one seed, one text
whatever k" test of test_speculative.py does not apply to it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPTS, exact_two_token_distribution, reuse_mismatches, two_token_samples
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.config import SamplingConfig
from edgespec.runtime import acceptance as sampler
from edgespec.runtime import speculative
from edgespec.runtime.drafters import Eagle3Drafter, make_drafter

torch = pytest.importorskip("torch")

from edgespec.export.eagle3 import aux_features  # noqa: E402  (needs torch)

T1 = SamplingConfig(temperature=1.0)
PROMPT = "a b c"
AUX = (0, 1, 1)  # two-layer targets have no default (aux_layers.py): the config names a repeat


@pytest.fixture(scope="module")
def eagle(checkpoints, tmp_path_factory):
    """Packages of a target and a random EAGLE-3 head: the BPE Llama (a head scoring 300 of
    its 400 tokens; fp32 and int4) and the 8-word one (6 of 8: q = 0 on two tokens); with the
    head folders."""
    from transformers import AutoConfig

    from edgespec.export import export_pair
    from edgespec.export.eagle3 import write_random_head

    root = tmp_path_factory.mktemp("eagle3")
    made = {}
    for name, target, vocab, init, quantize in (
            ("llama", "llama_target", 300, 0.05, None),
            ("words", "words_target_fused", 6, 0.3, None),
            ("llama_int4", "llama_target", 300, 0.05, "int4")):  # target and head int4
        config = AutoConfig.from_pretrained(checkpoints[target])
        head = write_random_head(root / f"{name}_head", config, draft_vocab=vocab, seed=5,
                                 aux_layers=AUX, init=init)
        export_pair(checkpoints[target], head, root / name, quantize=quantize)
        made[name] = (edgespec.load(root / name), head, checkpoints[target])
    return made


def _reference(made):
    """(the package's pipeline, the PyTorch target, the head's config, its PyTorch reference)."""
    from transformers import AutoModelForCausalLM

    from edgespec.export.eagle3 import Eagle3Head, HeadTensors, read_head_config

    pipe, head_folder, target_folder = made
    model = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    config = read_head_config(head_folder, model.config)
    reference = Eagle3Head.load(config, HeadTensors(config),
                                model.model.embed_tokens.weight.detach())
    return pipe, model, config, reference


def test_the_head_runs_as_the_pytorch_reference_reads_its_rows(eagle):
    """The first proposal is the reference's row c-2 on (x_1..x_{c-1}, the target's aux
    streams of positions 0..c-2); the next is row c-1 on (the draft, the head's own
    hidden_out). A drafter feeding row j the token x_j instead of x_{j+1} fails this."""
    from edgespec.runtime.stats import GenerationStats

    pipe, model, config, reference = _reference(eagle["llama"])
    ids = pipe.encode("def add(a, b):\n    return")
    drafter = make_drafter(edgespec.GenerationConfig(), pipe.draft,
                           GenerationStats(speculative=True), positions=64)
    assert isinstance(drafter, Eagle3Drafter)
    speculative._prefill(pipe.target, drafter, list(ids), 64, GenerationStats(speculative=True))
    q = drafter.next_row(list(ids), [], T1)
    draft = int(q.ids[np.argmax(q.weights)]) if q.ids is not None else int(np.argmax(q.weights))
    q_next = drafter.next_row(list(ids), [draft], T1)

    c = len(ids)
    features = aux_features(model, torch.tensor([ids[:-1]]), config)  # positions 0..c-2
    logits, hidden, cache = reference(torch.tensor([ids[1:]]), features,
                                      torch.arange(c - 1)[None])
    chained, _, _ = reference(torch.tensor([[draft]]), hidden[:, -1:],
                              torch.tensor([[c - 1]]), cache)
    targets = pipe.draft.token_ids
    for row, dist in ((logits[0, -1], q), (chained[0, -1], q_next)):
        expected = np.zeros(pipe.manifest.vocab_size)
        expected[targets] = torch.softmax(row.double(), -1).numpy()
        np.testing.assert_allclose(dist.dense(pipe.manifest.vocab_size), expected, atol=1e-5)


def test_after_verification_the_head_reruns_the_committed_rows_on_target_features(eagle):
    """A round drafts 3 tokens (row c-2 on target features, rows c-1 and c on the head's own
    hidden_out), the target accepts one and replaces the next: the head's next proposal, row
    c, is the reference's on the target's features of every position 0..c. A drafter that
    keeps its chain rows after the rollback (reads row c-1's hidden_out-based keys) fails."""
    from edgespec.runtime.stats import GenerationStats

    pipe, model, config, reference = _reference(eagle["llama"])
    ids = pipe.encode("import numpy as np\nx =")
    c = len(ids)
    drafter = make_drafter(edgespec.GenerationConfig(), pipe.draft,
                           GenerationStats(speculative=True), positions=64)
    runner = speculative._prefill(pipe.target, drafter, list(ids), 64,
                                  GenerationStats(speculative=True))
    drafts = drafter.propose(list(ids), 3, SamplingConfig(temperature=0.0), None).tokens
    assert len(drafts) == 3
    runner.run(list(ids), drafts)  # the target's features of positions c-1..c+2
    replacement = (drafts[1] + 1) % pipe.manifest.vocab_size
    runner.cache.crop(c + 1)
    drafter.rollback(c + 1)  # the first draft accepted, the second replaced
    committed = [*ids, drafts[0], replacement]
    q = drafter.next_row(committed, [], T1)

    features = aux_features(model, torch.tensor([committed[:-1]]), config)  # 0..c
    logits, _, _ = reference(torch.tensor([committed[1:]]), features, torch.arange(c + 1)[None])
    expected = np.zeros(pipe.manifest.vocab_size)
    expected[pipe.draft.token_ids] = torch.softmax(logits[0, -1].double(), -1).numpy()
    np.testing.assert_allclose(q.dense(pipe.manifest.vocab_size), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "words", "llama_int4"])
def test_greedy_with_a_head_equals_target_only(eagle, name):
    pipe = eagle[name][0]
    prompts = ["a b c", "g f e d", "b"] if name == "words" else PROMPTS
    drafted = accepted = 0
    for prompt in prompts:
        baseline = pipe.generate(prompt, max_new_tokens=40, drafter="none", ignore_eos=True)
        for k in range(1, 7):
            result = pipe.generate(prompt, max_new_tokens=40, draft_length=k, schedule="fixed",
                                   ignore_eos=True)
            assert result.token_ids == baseline.token_ids, (prompt, k)
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert drafted > 0
    if name == "words":  # partial rounds: the head's catch-up over several rows ran
        assert 0 < accepted < drafted


@pytest.mark.parametrize("name", ["llama", "llama_int4"])
def test_greedy_with_a_head_is_the_same_with_kept_caches(eagle, name):
    """The head's state (target features, rows, its cache) is kept with the target's cache and
    cropped with it (runtime/prefix_cache.py): the next generation drafts on from the shared
    prefix and gives a fresh pipeline's tokens, on a float and an int4 target."""
    pipe = eagle[name][0]
    fresh = edgespec.load(pipe.path, prefix_cache_slots=0)
    mismatches, reused, drafted = reuse_mismatches(pipe, fresh, PROMPTS, max_new_tokens=16,
                                                   draft_length=2, schedule="fixed")
    assert mismatches == [] and reused > 0 and drafted > 0


def test_the_greedy_check_fails_for_a_loop_that_accepts_every_draft(eagle, monkeypatch):
    monkeypatch.setattr(
        speculative, "verify_greedy", lambda d, logits: (len(d), int(logits[len(d)].argmax())))
    pipe = eagle["words"][0]
    differs = [pipe.generate(p, max_new_tokens=24, draft_length=3, schedule="fixed",
                             ignore_eos=True).token_ids
               != pipe.generate(p, max_new_tokens=24, drafter="none", ignore_eos=True).token_ids
               for p in ("a b c", "g f e d")]
    assert any(differs)


def test_sampling_with_a_head_follows_the_target_distribution(eagle):
    pipe = eagle["words"][0]
    expected = exact_two_token_distribution(pipe, T1, PROMPT)
    assert max(expected.values()) < 0.5
    samples, drafted, accepted = two_token_samples(pipe, T1, 3000, PROMPT)
    assert drafted >= 2 * 3000 and 0 < accepted < 0.9 * drafted
    assert fit_pvalue(samples, expected) > ALPHA


def test_the_distribution_check_rejects_accepting_without_the_ratio(eagle, monkeypatch):
    """Accepting every draft token the head proposes (no min(1, p/q) test) gives the head's
    distribution, not the target's."""
    monkeypatch.setattr(sampler, "accept_or_replace", lambda x, p, q, u: (True, x))
    pipe = eagle["words"][0]
    samples, _, _ = two_token_samples(pipe, T1, 1500, PROMPT)
    assert fit_pvalue(samples, exact_two_token_distribution(pipe, T1, PROMPT)) < 1e-6


def test_the_adaptive_schedule_times_the_head_and_stays_exact(eagle):
    pipe = eagle["llama"][0]
    baseline = pipe.generate(PROMPTS[0], max_new_tokens=30, drafter="none")
    result = pipe.generate(PROMPTS[0], max_new_tokens=30, draft_length=4, schedule="adaptive")
    assert result.token_ids == baseline.token_ids
    assert pipe.step_costs(4).draft_step_ms > 0


def test_export_refuses_a_malformed_head_and_an_optimum_target(checkpoints, eagle, tmp_path):
    """One error naming the fault: d2t out of the target's range, or a target graph (optimum's)
    without the head's input."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from edgespec.errors import ExportError
    from edgespec.export import export_pair

    head = eagle["llama"][1]
    with pytest.raises(ExportError, match="only edgespec's fused target graph"):
        export_pair(checkpoints["llama_target"], head, tmp_path / "optimum", graph="optimum")
    broken = tmp_path / "broken"
    shutil.copytree(head, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["d2t"] = weights["d2t"] + 10_000
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match="d2t maps draft ids outside"):
        export_pair(checkpoints["llama_target"], broken, tmp_path / "bad")
    config = json.loads((head / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(ExportError, match="hidden_size 32 is not the target's 64"):
        export_pair(checkpoints["llama_target"], broken, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "optimum").exists()


def test_the_package_says_its_draft_is_a_head(eagle):
    from edgespec.models import describe_package

    pipe = eagle["llama_int4"][0]
    assert pipe.manifest.draft.architecture == "eagle3"
    assert pipe.manifest.draft.compute == "int8"  # quantized as drafts are
    assert "draft an EAGLE-3 head, 1 layers" in describe_package("p", pipe.path)[1]


def test_a_head_is_chosen_as_the_model_and_reported_as_eagle3(eagle):
    """``drafter="model"`` (and "auto") choose whatever draft the package has; the stats, and
    so the bench's table, name what drafted: "eagle3" for a head."""
    pipe = eagle["llama"][0]
    for drafter in ("model", "auto"):
        result = pipe.generate("a b", max_new_tokens=4, drafter=drafter, ignore_eos=True)
        assert result.stats.drafter == "eagle3"
