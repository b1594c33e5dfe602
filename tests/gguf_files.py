"""GGUF files written for the tests from tiny random checkpoints, with llama.cpp's own writer and
quantizer (gguf-py) as its convert_hf_to_gguf.py writes them (q/k rows permuted for Llama);
K-quants, which gguf-py cannot make, as random blocks with sane scales. Shared by the tests
that export GGUF files (test modules never import each other)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from conftest import _hf_tokenizer, _train_bpe

Q = gguf.GGMLQuantizationType

# HF name (without "model.") -> GGUF name, per layer
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (its rotary layout)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _model(kind: str, seed: int, tied: bool, hidden: int = 64, rope_scaling: dict | None = None):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    bpe = _hf_tokenizer(_train_bpe(400))
    if kind in ("qwen2", "qwen3"):  # transformers' Qwen2 GGUF tokenizer (Qwen3's too) adds
        # these unless the file has them
        bpe.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[kind]
    # Qwen3: heads of 32 where hidden / heads is 16, and not Qwen3Config's default 128 either
    head = {"head_dim": 32} if kind == "qwen3" else {}
    torch.manual_seed(seed)
    config = config_class(vocab_size=len(bpe), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                          pad_token_id=0, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                          rope_theta=10000.0, rope_scaling=rope_scaling, **head)
    model = model_class(config).eval()
    with torch.no_grad():  # weights of a trained model's size, norms away from 1
        for name, p in model.named_parameters():
            p.normal_(1, 0.1) if "norm" in name else p.normal_(0, 0.3 if "bias" in name else 0.08)
    return model, bpe


# prompts whose greedy continuations n-gram drafting can predict (tokens get drafted)
NGRAM_PROMPTS = ("def add(a, b):\n    return a + b\ndef add(a, b):\n", "a b a b a b a b")


def write_gguf(path: Path, kind: str, types: dict[str, str], seed: int = 0, tied: bool = True,
               tokenizer: bool = True, architecture: str | None = None, hidden: int = 64,
               value_length: int | None = None, rope_scaling: dict | None = None,
               chat_template: str | None = None) -> Path:
    """A GGUF file of a tiny random ``kind`` model, tensors quantized as ``types`` says (GGUF
    short names: "attn_q", "token_embd", ... -> "Q4_1"; others F32), with the tests' tokenizer
    as tokenizer.ggml.* metadata. K-quants (which gguf-py cannot make) are random blocks."""
    model, bpe = _model(kind, seed, tied, hidden, rope_scaling)
    cfg = model.config
    writer = _writer(path, architecture or kind, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if kind == "qwen3":  # as llama.cpp's converter writes a config.json's head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(value_length or head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        backend = json.loads(bpe.backend_tokenizer.to_str())
        vocab = sorted(backend["model"]["vocab"].items(), key=lambda item: item[1])
        specials = {t.content for t in bpe.added_tokens_decoder.values()}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                                 for m in backend["model"]["merges"]])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    for name, value in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        short = _gguf_name(name)
        w = value.float().numpy()
        base = short.split(".")[-2] if short.startswith("blk.") else short.split(".")[0]
        if kind == "llama" and base in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if base == "attn_q" else cfg.num_key_value_heads
            w = _permute(w, heads)
        qtype = types.get(base, "F32") if name.endswith("weight") and w.ndim == 2 else "F32"
        layer = int(short.split(".")[1]) if short.startswith("blk.") else None
        qtype = types.get(f"{base}.{layer}", qtype)
        _add_tensor(writer, short, w, qtype)
    if rope_scaling:  # as llama.cpp's converter writes Llama 3's scaling
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(rope_scaling, cfg))
    _finish(writer)
    return path


def _writer(path: Path, architecture: str, cfg):
    """A GGUFWriter with the metadata every family's file holds, from ``cfg``."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny {architecture}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def _add_tensor(writer, short: str, w: np.ndarray, qtype: str) -> None:
    """``w`` as a GGUF tensor of ``qtype`` (K-quants, which gguf-py cannot make: random blocks)."""
    if qtype == "F32":
        writer.add_tensor(short, np.ascontiguousarray(w, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(short, w.astype(np.float16))
    elif qtype in K_QUANTS:
        writer.add_tensor(short, _raw(qtype, *w.shape, seed=sum(map(ord, short))),
                          raw_dtype=Q[qtype])
    elif qtype == "Q8_K":  # no quantizer in gguf-py: one block of zeros (the shape is wrong)
        writer.add_tensor(short, np.zeros((1, 292), np.uint8), raw_dtype=Q.Q8_K)
    else:
        writer.add_tensor(short, gguf.quants.quantize(w, Q[qtype]), raw_dtype=Q[qtype])


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_rope_freqs(scaling: dict, cfg) -> np.ndarray:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes them for Llama 3 (its
    LlamaModel's loop over the frequencies, written out again here)."""
    import math

    dim = cfg.hidden_size // cfg.num_attention_heads
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


# llama: q/k/v Q4_1 (permuted blocks with minimums), o Q8_0, gate/up Q4_0, down Q4_1 in layer 0
# and F16 (kept) in layer 1, the tied table Q8_0 (float in a target, gathered and dequantized by
# plain operators in a draft)
LLAMA = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q8_0",
         "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "ffn_down.1": "F16",
         "token_embd": "Q8_0"}
# qwen2, untied: q/k Q4_0 beside v Q8_0 (no shared layout: a MatMul each), q/k/v biases, o
# Q5_0 (8-bit blocks), the MLP Q8_0, the table Q4_1 (nibbles split in the graph),
# the output layer Q4_0
QWEN2 = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_0",
         "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q8_0", "token_embd": "Q4_1",
         "output": "Q4_0"}
# qwen3 (per-head q/k norms, F32), tied Q4_0 table: q/k/v Q4_0, o and the MLP Q4_1
QWEN3 = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1", "token_embd": "Q4_0"}
# llama, tied Q4_0 table: GatherBlockQuantized and the output layer's MatMulNBits share it
LLAMA_Q4_0 = {k: "Q4_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                   "ffn_up", "ffn_down", "token_embd")}
# llama with K-quants (hidden 256: a super-block): Q4_K (blocks of 32 with minimums) and Q6_K
# (8 bits, blocks of 16), the tied table Q6_K
LLAMA_K = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


def assert_compact(manifest, package: Path) -> None:
    """The graph keeps the file's blocks in about their bytes: its stored weights (inline,
    in the data file, and the parts of tensors made at load) take at most 1.15x the file's
    tensors (its block-sum matrices aside: the graph's own constants; its rotary tables are
    made at load)."""
    import onnx
    from gguf import GGUFReader

    source = sum(int(t.n_bytes) for t in GGUFReader(manifest.source["target"]).tensors)
    graph = onnx.load(str(package / "target" / "model.onnx"), load_external_data=False).graph
    own = ("block_sums",)
    stored = 0
    for t in graph.initializer:
        if t.name.startswith(own):
            continue
        where = {e.key: e.value for e in t.external_data}
        stored += len(t.raw_data) if not where else int(where.get("length", 0))

    def parts(recipe):
        if not isinstance(recipe, dict):
            return 0
        return recipe.get("length", 0) + sum(parts(v) for v in recipe.values())

    unpack = package / "target" / "unpack.json"
    stored += sum(map(parts, json.loads(unpack.read_text()).values())) if unpack.exists() else 0
    assert stored <= 1.15 * source, (stored, source)


# -- blocks of a type ---------------------------------------------------------------------------

K_QUANTS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes a super-block of 256


def _raw(qtype: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """llama.cpp blocks of ``qtype``: gguf-py's quantizer where it has one; random bytes with
    sane scales for the K-quants (any bytes are a valid block but for NaN/inf scales)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        scale = (1e-5, 1e-4) if qtype != "Q4_K" else (2e-5, 2e-4)  # weights of about 0.05
        raw = rng.integers(0, 256, (rows, columns // 256, K_QUANTS[qtype]), dtype=np.uint8)
        d = rng.uniform(*scale, (rows, columns // 256, 1)).astype(np.float16).view(np.uint8)
        if qtype in ("Q4_K", "Q5_K"):  # d and dmin
            raw[..., 0:2], raw[..., 2:4] = d, d
        else:
            raw[..., 208:210] = d
        return raw.reshape(rows, -1)
    w = (rng.standard_normal((rows, columns)) * 0.05 + rng.standard_normal((rows, 1)) * 0.02
         ).astype(np.float32)
    w[0, :32] = 0.25  # a flat block: scale 0, every weight the minimum
    return gguf.quants.quantize(w, Q[qtype])


# -- Gemma 3 ---------------------------------------------------------------------------------------

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# llama.cpp's Gemma 3 names (gguf-py's constants) of the norms Llama lacks or names otherwise
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
# the Gemma 3 270M file's types: q/k and the MLP's gate/up Q5_0, v Q8_0, o Q4_K, down Q6_K, the
# tied table Q8_0 (hidden and 4 heads of 64 are 256: a K-quant super-block)
GEMMA3 = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
          "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"}


def gemma_tokenizer():
    """A SentencePiece-style Unigram tokenizer (pieces with scores, "▁" for spaces) trained on
    the tests' corpus, with Gemma's special tokens first, as Gemma's tokenizer has them."""
    from conftest import CORPUS
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=GEMMA_SPECIALS,
                                      unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())["model"]["vocab"]  # [[piece, score], ...]


# Gemma 3 instruct files' template, shortened (no system turn, no images)
GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                  "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                  "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def write_gemma3_gguf(path: Path, types: dict[str, str], seed: int = 0, hidden: int = 256,
                      window: int = 8, layers: int = 6, template: str | None = None,
                      scores: bool = True, extra: dict | None = None) -> tuple[Path, object]:
    """A GGUF file of a tiny random Gemma 3 as llama.cpp's convert_hf_to_gguf.py writes one
    (norm weights + 1, no q/k permutation, a SentencePiece vocabulary with scores; no
    sliding-window pattern: llama.cpp's is every sixth layer global), and the model it holds
    (the config llama.cpp reads: query_pre_attn_scalar head_dim, local rope base 10,000).
    ``template``: a chat template; ``scores`` False: the last piece's score left out;
    ``extra``: more metadata, strings and floats (a Gemma 2 style final_logit_softcapping)."""
    from conftest import gemma3

    pieces = gemma_tokenizer()
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(layers)]
    model = gemma3(len(pieces), hidden, seed, window=window, num_hidden_layers=layers,
                   layer_types=kinds, head_dim=64, query_pre_attn_scalar=64, bos_token_id=2,
                   eos_token_id=1, pad_token_id=0)
    cfg = model.config
    writer = _writer(path, "gemma3", cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p for p, _ in pieces])
    writer.add_token_scores([float(s) for _, s in pieces][:None if scores else -1])
    writer.add_token_types([3 if p in GEMMA_SPECIALS else 1 for p, _ in pieces])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if template:
        writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(key, value)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = value.float().numpy()
        if name.endswith("norm.weight"):  # llama.cpp's Gemma converter: + 1
            w = w + 1
        module = name.split(".")[-2]
        short = (f"blk.{name.split('.')[2]}.{_GEMMA_NORMS[module]}.weight"
                 if module in _GEMMA_NORMS else _gguf_name(name))
        base = short.split(".")[-2] if short.startswith("blk.") else short.split(".")[0]
        qtype = types.get(base, "F32") if w.ndim == 2 else "F32"
        _add_tensor(writer, short, w, qtype)
    _finish(writer)
    return path, model
