"""Gemma 3 through the fused builder, from a Hugging Face folder and from a GGUF file: the graphs
pass fp32's gate against PyTorch past the sliding window, greedy output with a draft model or
n-gram drafting is target-only output, the gate refuses a graph that gets one of Gemma's facts
wrong, and a GGUF file's blocks are kept.

The checkpoints are tiny random Gemma 3s (conftest.gemma3): local layers with a window of 8
around a global one, each kind with its own rope base, norms away from Gemma's 1 + 0, q.k
scaled by a query_pre_attn_scalar other than head_dim. The GGUF file (gguf_files.py) has six
layers (llama.cpp's pattern: the sixth global) in the 270M file's block types.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import _hf_tokenizer, _save, _train_bpe, gemma3, greedy_is_target_only, noisy_copy
from helpers import PROMPTS

import edgespec
from edgespec.cli import main
from edgespec.errors import ExportError
from edgespec.export import export_pair
from edgespec.export.families import why_not_fused
from edgespec.export.graph import load_model
from edgespec.export.validate import reference_logits
from edgespec.manifest import Manifest

gguf = pytest.importorskip("gguf")
from gguf_files import (GEMMA3, GEMMA_TEMPLATE, NGRAM_PROMPTS, assert_compact, write_gemma3_gguf,  # noqa: E402
                        write_gguf)

WINDOW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A bf16 tied target (as Gemma 3 ships), a noisy copy as its draft."""
    root = tmp_path_factory.mktemp("gemma3")
    bpe = _hf_tokenizer(_train_bpe(400))
    target = gemma3(len(bpe), 64, seed=1, window=WINDOW)
    return {
        "target": _save(target.to(torch.bfloat16), bpe, root / "target"),
        "draft": _save(noisy_copy(target.float(), 0.1, seed=2).to(torch.bfloat16), bpe,
                       root / "draft"),
    }


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gemma3_pair") / "pkg"
    result = CliRunner().invoke(main, ["export", "--target", str(checkpoints["target"]),
                                       "--draft", str(checkpoints["draft"]), "--out", str(root)])
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[Path, object]:
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3_gguf") / "gemma.gguf", GEMMA3,
                             seed=3, window=WINDOW, template=GEMMA_TEMPLATE)


@pytest.fixture(scope="module")
def gguf_package(gguf_file, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gemma3_gguf_pkg") / "pkg"
    export_pair(gguf_file[0], None, root)
    return root


def test_the_pair_passes_fp32s_gate_past_the_window(pair):
    manifest = Manifest.read(pair)
    for spec in (manifest.target, manifest.draft):
        validation = spec.validation
        assert spec.graph == "fused" and spec.architecture == "gemma3_text"
        assert validation["reference"] == "PyTorch, layer by layer"
        assert validation["failures"] == [] and validation["positions"] > WINDOW + 16
        assert validation["max_abs_diff_no_cache"] <= validation["tolerance"]
        assert validation["max_abs_diff_one_token_steps"] <= validation["tolerance"]


def test_the_layer_by_layer_reference_is_the_whole_model(checkpoints):
    """The reference the gate uses (one layer at a time, each kind's mask and rotary, the rows
    scaled in the table's type) equals transformers' whole model in float32 but for the
    embedding scale's type: the same numbers when the table is float32."""
    from edgespec.export.graph import meta_model
    from edgespec.export.tensors import ModelTensors
    from edgespec.export.validate import reference_logits_by_layer

    model = load_model(checkpoints["target"]).float()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 3 * WINDOW)
    by_layer = reference_logits_by_layer(meta_model(model.config), ModelTensors(model), ids)
    assert np.array_equal(by_layer, reference_logits(model, ids))


def test_greedy_output_with_the_draft_is_target_only_output(pair):
    """Past the window (8 positions) within the first prompt already; k = 3 fixed."""
    pipe = edgespec.load(pair)
    drafted, accepted = greedy_is_target_only(pipe, PROMPTS[:3], 3)
    assert drafted > 0 and accepted > 0


def test_a_seed_gives_one_sampled_text_whatever_the_draft_length(pair):
    """The sampled loop at Gemma's shapes: every position draws with its own random numbers,
    so one seed gives one text at k = 2 and k = 4 (docs/generate.md, --seed), with tokens drafted."""
    pipe = edgespec.load(pair)
    texts = [pipe.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, seed=5,
                           draft_length=k, schedule="fixed") for k in (2, 4)]
    assert texts[0].token_ids == texts[1].token_ids
    assert texts[0].stats.drafted > 0 and texts[1].stats.drafted > 0


# -- the gate refuses each fact wrong -------------------------------------------------------------

def _wrong_window(config, layer):
    from edgespec.export.families import layer_window

    window = layer_window(config, layer)
    return None if window is None else window - 1


@pytest.mark.parametrize("name,wrong", [
    ("layer_window", _wrong_window),  # one position short
    ("layer_window", lambda config, layer: None),  # every layer global
    ("norm_offset", lambda config: 0.0),  # scaled by w, not 1 + w
    ("embed_scale", lambda config, dtype: 1.0),  # rows unscaled
    ("local_rope_config", lambda config: config),  # local layers rotating with rope_theta
    ("attention_scale", lambda config: config.head_dim**-0.5),  # not query_pre_attn_scalar
])
def test_a_graph_with_a_gemma_fact_wrong_fails_the_gate(checkpoints, tmp_path, monkeypatch,
                                                        name, wrong):
    from edgespec.export import fused

    monkeypatch.setattr(fused, name, wrong)
    with pytest.raises(ExportError, match="no_cache logits differ from PyTorch"):
        export_pair(checkpoints["target"], None, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()


def test_final_logit_softcapping_passes_the_gate(tmp_path):
    bpe = _hf_tokenizer(_train_bpe(400))
    folder = _save(gemma3(len(bpe), 64, seed=4, final_logit_softcapping=0.5), bpe,
                   tmp_path / "capped")
    validation = export_pair(folder, None, tmp_path / "pkg").target.validation
    assert validation["failures"] == [] and validation["logit_scale"] == 1.0  # |logits| < 0.5


@pytest.mark.parametrize("options,named", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation silu"),
])
def test_what_the_builder_lacks_is_named(options, named):
    from transformers import Gemma3TextConfig

    assert named in why_not_fused(Gemma3TextConfig(**options))


# -- GGUF -----------------------------------------------------------------------------------------

def test_a_gguf_file_keeps_its_blocks_and_passes_fp32s_gate(gguf_package):
    manifest = Manifest.read(gguf_package)
    validation = manifest.target.validation
    weights = validation["gguf"]
    assert manifest.target.architecture == "gemma3_text" and validation["failures"] == []
    assert validation["variant"] == "fp32" and validation["positions"] > WINDOW + 16
    assert validation["max_abs_diff_no_cache"] <= validation["tolerance"]
    assert weights["requantized"] is False and "dequantized" not in weights["tensors"]
    # 6 layers: q, k, gate, up Q5_0; v Q8_0 and the tied table; o Q4_K; down Q6_K
    assert weights["tensors"]["repacked"] == {"Q5_0": 24, "Q8_0": 7, "Q4_K": 6, "Q6_K": 6}
    assert weights["tensors"]["kept"] == {"F32": 6 * 6 + 1}  # the norms
    assert_compact(manifest, gguf_package)


def test_a_gguf_file_is_the_model_it_was_written_from(tmp_path):
    """Every tensor F32: the export equals the checkpoint llama.cpp's converter would have
    read (norms + 1 taken off, every sixth layer global, local rope base 10,000, q.k by
    head_dim), not only the model transformers' GGUF loader builds from the file."""
    file, model = write_gemma3_gguf(tmp_path / "f32.gguf", {}, seed=5, window=WINDOW)
    manifest = export_pair(file, None, tmp_path / "pkg")
    pipe = edgespec.load(tmp_path / "pkg")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 3 * WINDOW + 6)
    logits = pipe.target.forward(ids, pipe.target.new_cache())
    expected = reference_logits(model, ids)
    assert np.abs(logits - expected).max() <= manifest.target.validation["tolerance"]


def test_a_constraint_writes_spaces_with_a_gguf_files_tokenizer(gguf_package):
    """Gemma's SentencePiece pieces ("▁the") through the grammar engine (test_gguf.py's
    check, on the tokenizer made from the file's pieces)."""
    from test_gguf import assert_constrained_words

    assert_constrained_words(edgespec.load(gguf_package))


def test_greedy_output_with_ngram_drafting_is_target_only(gguf_package):
    pipe = edgespec.load(gguf_package)
    drafted, _ = greedy_is_target_only(pipe, NGRAM_PROMPTS, 4, "ngram")
    assert drafted > 0


def test_a_gguf_chat_template_renders_gemmas_turns_and_a_turn_ends_a_reply(gguf_package):
    """The file's chat template is the package's; <end_of_turn> ends a reply beside <eos>
    (the file names only <eos>)."""
    manifest = Manifest.read(gguf_package)
    pipe = edgespec.load(gguf_package)
    turn_end = pipe.tokenizer.token_to_id("<end_of_turn>")
    assert sorted(manifest.eos_token_ids) == sorted([1, turn_end])
    ids = pipe.encode_chat([{"role": "user", "content": "def add(a, b):"}])
    text = pipe.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<bos><start_of_turn>user\ndef add(a, b):<end_of_turn>\n<start_of_turn>model\n"
    assert ids.count(pipe.tokenizer.token_to_id("<bos>")) == 1


def test_a_gguf_target_takes_an_eagle3_head(gguf_file, tmp_path):
    """A head beside a Gemma 3 GGUF target: validated against PyTorch, and greedy output with
    it (k = 3) is target-only's, tokens drafted."""
    from edgespec.export.eagle3 import write_random_head
    from edgespec.export.gguf import read_gguf_checkpoint

    config = read_gguf_checkpoint(gguf_file[0], "target").config
    head = write_random_head(tmp_path / "head", config, draft_vocab=None, seed=2,
                             aux_layers=(0, 2, 4), init=0.05)
    manifest = export_pair(gguf_file[0], head, tmp_path / "pair")
    assert manifest.draft.architecture == "eagle3" and manifest.draft.validation["failures"] == []
    pipe = edgespec.load(tmp_path / "pair")
    drafted = 0
    for prompt in PROMPTS[:2]:
        baseline = pipe.generate(prompt, max_new_tokens=24, drafter="none").token_ids
        result = pipe.generate(prompt, max_new_tokens=24, draft_length=3, schedule="fixed")
        assert result.token_ids == baseline
        drafted += result.stats.drafted
    assert drafted > 0


def test_an_unread_family_is_refused_at_once_naming_what_is_read(tmp_path):
    """A GGUF of a family edgespec does not read is refused by its header, before torch loads:
    one line naming the families it reads, gemma3 among them."""
    bad = write_gguf(tmp_path / "g2.gguf", "llama", {}, architecture="gemma2")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edgespec", "export", "--target", str(bad),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60)
    elapsed = time.perf_counter() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr
    assert "architecture gemma2" in lines[0] and "llama, qwen2, qwen3, gemma3" in lines[0]
    assert elapsed < 10  # the command's start; the check itself reads a header (the goal: 2 s)
    assert not (tmp_path / "out").exists()


def _llama_cpp_spm(text: str, pieces: list[tuple[str, float]]) -> list[int]:
    """llama.cpp's SPM tokenizer (src/llama-vocab.cpp, llm_tokenizer_spm), written out plainly:
    spaces as "▁", characters merged pair by pair, the highest-scoring resulting piece first
    (the leftmost of equals); what is left unknown becomes <unk> (no byte pieces here)."""
    ids = {piece: i for i, (piece, _) in enumerate(pieces)}
    scores = dict(pieces)
    symbols = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = symbols[i] + symbols[i + 1]
            if merged in scores and (best is None or scores[merged] > best[0]):
                best = (scores[merged], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [ids.get(s, ids["<unk>"]) for s in symbols]


def test_a_gguf_vocabulary_splits_text_as_llama_cpp_does(gguf_file):
    """The package's tokenizer (SentencePiece BPE from the file's pieces and scores) gives
    llama.cpp's ids; transformers' own reading of the file (a Unigram model over the same
    scores) does not, which is what the test would catch."""
    from conftest import CORPUS
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import read_field

    from edgespec.export.gguf import read_gguf_checkpoint

    file = gguf_file[0]
    ours = read_gguf_checkpoint(file, "target").tokenizer
    unigram = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    reader = gguf.GGUFReader(file)
    pieces = list(zip(read_field(reader, "tokenizer.ggml.tokens"),
                      read_field(reader, "tokenizer.ggml.scores")))
    texts = sorted(set(CORPUS)) + ["the quick fox, the lazy dog", "print(np.zeros(3))"]
    differs = 0
    for text in texts:
        expected = _llama_cpp_spm(text, pieces)
        assert ours(text, add_special_tokens=False).input_ids == expected, text
        assert ours.decode(expected) == text
        differs += unigram(text, add_special_tokens=False).input_ids != expected
    assert differs > 0


@pytest.mark.parametrize("options,match", [
    (dict(window=2**21), "attention.sliding_window is 2,097,152"),
    (dict(scores=False), "pieces come with"),
    (dict(extra={"gemma3.final_logit_softcapping": "thirty"}), "not a number a model has"),
])
def test_a_bad_gemma_file_is_a_one_line_error(tmp_path, options, match):
    bad, _ = write_gemma3_gguf(tmp_path / "bad.gguf", {}, seed=6, **options)
    result = CliRunner().invoke(main, ["export", "--target", str(bad), "--out",
                                       str(tmp_path / "out")])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and match in errors[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_gguf_final_logit_softcapping_is_read_and_passes_the_gate(tmp_path):
    """llama.cpp reads gemma3.final_logit_softcapping where a file has one: so does the
    export, and the graph caps as PyTorch does (the cap below the logits' size, so it acts)."""
    file, _ = write_gemma3_gguf(tmp_path / "capped.gguf", {}, seed=7,
                                extra={"gemma3.final_logit_softcapping": 0.5})
    validation = export_pair(file, None, tmp_path / "pkg").target.validation
    assert validation["failures"] == [] and validation["logit_scale"] == 1.0
