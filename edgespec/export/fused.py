"""A fused ONNX graph for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, Gemma 3), written
from the checkpoint's weights.

(Over 400 lines on purpose: one builder writes the whole graph in one pass, and the ops of a
layer, with the checkpoint's float weights and a GGUF file's own blocks, read best together.)

optimum's graph spells attention out in ~100 small ops a layer (shape arithmetic, rotary
slices, concatenating the cache), and each op costs dispatch time that dominates a small
model's decode step. This builder emits the few fused onnxruntime operators the model needs
(the approach of onnxruntime-genai's model builder; the graph here is written independently):

    Gather(embedding)  (Gemma: * sqrt(hidden))
    per layer:  SkipSimplifiedLayerNormalization  (residual add + RMSNorm)
                MatMul(q|k|v fused)  -> GroupQueryAttention (rotary, causal, KV cache)
                    (Qwen3, Gemma: q and k split off and RMS-normalized head by head first;
                     Gemma's sliding layers: GroupQueryAttention's local window)
                MatMul(o)  (Gemma: -> SimplifiedLayerNormalization)
                -> SkipSimplifiedLayerNormalization
                MatMul(gate|up fused) -> SiLU(gate) * up -> MatMul(down)
                    (Gemma: GELU(tanh) instead of SiLU, -> SimplifiedLayerNormalization)
    SkipSimplifiedLayerNormalization -> MatMul(lm_head) -> logits  (Gemma: softcapped if set)

Inputs and outputs keep the names of optimum's graph (input_ids, attention_mask,
past_key_values.i.key/value -> logits, present.i.key/value), so the runtime drives both alike.
GroupQueryAttention also accepts a preallocated cache bound as both past and present, which lets
the runtime append in place and roll back by changing a length (``runtime/session.py``).

Positions come from the attention mask (GroupQueryAttention rotates token j of a run at position
total_length - run_length + j), so the graph has no position_ids input.

The model is never loaded whole: the weights are read from the checkpoint one tensor at a time
(``tensors.py``) and written as they are read, and int4/int8 graphs get their MatMulNBits and
GatherBlockQuantized weights quantized on the way (``precision.quantize_blocks``), not a float
graph rewritten by onnxruntime's quantizer afterwards. A 7B model's export then holds about one
layer (0.5 GB in bf16) and its embedding table, not the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel

from edgespec.errors import ExportError
from edgespec.export.families import (GEMMA, QK_NORM, attention_scale, embed_scale,
                                      head_dim_of, layer_window, local_rope_config, norm_offset,
                                      why_not_fused)
from edgespec.export.memory import trim
from edgespec.export.onnx_io import EXTERNAL_ABOVE, WeightStore, write_graph
from edgespec.export.precision import INT8_COMPUTE, QUANT_BLOCK_SIZE, quantize_blocks
from edgespec.manifest import FEATURES as EAGLE_FEATURES  # an EAGLE-3 head's input
from edgespec.manifest import LOGITS_TO_KEEP

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # the checkpoint's names
ONES_BYTES = 1 << 20  # block sums by a MatMul with ones up to this size of ones, else ReduceSum
_MS = "com.microsoft"
_OPSET = 17


def build_fused_graph(model: PreTrainedModel, tensors, folder: Path, keep_precision: bool = True,
                      bits: int | None = None, int8_compute: bool = False,
                      token_ids: np.ndarray | None = None,
                      progress: Callable[[str], None] | None = None,
                      eagle_fc: tuple[tuple[int, ...], torch.Tensor] | None = None,
                      block_size: int = QUANT_BLOCK_SIZE) -> dict:
    """Write folder/model.onnx for a Llama-family model; the graph computes in float32.

    model: the model's modules, on PyTorch's meta device (graph.meta_model: config, tying,
        rotary embedding), or loaded. tensors: its weights by checkpoint name, read one at a
        time (export/tensors.py): a layer's weights are read, written and dropped before the
        next layer's, so the build holds about one layer whatever the model's size.
    keep_precision: store each weight in the checkpoint's own type (bf16 or fp16) with a Cast
        to float32 that onnxruntime folds when the session loads: the package is as large as
        the checkpoint and computes exactly as an fp32 upcast would. False stores float32, for
        the passes that rewrite weights afterwards (fp16 conversion).
    bits: 4 or 8: every MatMul is a MatMulNBits with weights quantized as they are written
        (precision.quantize_blocks: block-wise symmetric, onnxruntime's quantizer's bytes), and
        in int4 the embedding a GatherBlockQuantized; a tied table is stored once, read by both
        ends. Other weights keep their precision. int8_compute: the MatMulNBits compute with
        int8 activations (accuracy_level 4). block_size: the blocks ``bits`` quantizes in.
    Weights go straight to disk as they are made (model.onnx_data above 64 MB of them).
    progress: a line after each layer (layers done, MB written, seconds). Returns the number of
    float weights per stored type.
    A source that holds quantized blocks already (export/gguf.py) hands them over through
    ``tensors.packed(names)``: those weights become MatMulNBits (and the embedding a gather of
    the same blocks) as they are, whatever ``bits`` says; ``bits`` applies to the others.
    eagle_fc: (aux layer ids, an EAGLE-3 head's fc weight ``[h, 3h]``): the graph also outputs
        ``eagle_features`` ``[1, sequence_length, h]`` = fc(cat of the residual streams entering
        those layers), the head's input for every row of a run (export/eagle3.py). The head's
        fc lives here rather than in the head graph: h floats a row leave the target, not 3h.
    """
    reason = why_not_fused(model.config)
    if reason:
        raise ExportError(f"cannot build a fused graph: {reason}; use --graph optimum")
    folder.mkdir(parents=True)
    tied = is_tied(model)
    # the int4 table is shared whenever it is one (not when the output scores a subset);
    # float graphs store a tied table once, transposed for the output layer's MatMul, except
    # float32 graphs bound for fp16 conversion, whose output layer keeps a MatMul of its own
    if bits:
        tie = tied and token_ids is None and bits == 4
    else:
        tie = tied and token_ids is None and keep_precision
    head_rows = 0 if tie or not tied else (
        len(token_ids) if token_ids is not None else model.config.vocab_size)
    if hasattr(tensors, "packed"):  # blocks as stored, some maybe dequantized: at most 8x
        stored = 8 * tensors.nbytes
    else:
        stored = _stored_bytes(model, tensors, keep_precision, bits, head_rows, block_size)
    external = stored > EXTERNAL_ABOVE
    with WeightStore(folder, external=external, keep_precision=keep_precision) as store:
        builder = _Builder(model, tensors, store, tie=tie, bits=bits, int8_compute=int8_compute,
                           token_ids=token_ids, progress=progress or (lambda line: None),
                           eagle_fc=eagle_fc, block_size=block_size)
        graph = builder.build()
        store.mark_packed(builder.nodes)
    write_graph(graph, folder, [("", _OPSET), (_MS, 1)])
    return store.counts


def is_tied(model: PreTrainedModel) -> bool:
    """Whether lm_head is the embedding table itself (then it is stored once)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def _stored_bytes(model, tensors, keep_precision: bool, bits: int | None,
                  head_rows: int, block_size: int) -> int:
    """About how many bytes of weights the graph will hold (decides external data).

    head_rows: rows of an output layer stored beside a tied table (0 when it is shared).
    """
    parameters = sum(p.numel() for p in model.parameters())  # a tied table once
    parameters += head_rows * model.config.hidden_size
    if bits:  # + a float32 scale a block
        return int(parameters * (bits + 32 / block_size) / 8)
    return tensors.nbytes if keep_precision else parameters * 4


class _NBits(NamedTuple):
    """A weight stored as MatMulNBits blocks: the initializers' names and the layout.
    ``minimums``: a float offset per block (``[K / block_size, N]``; the blocks' zero points
    ``zero_points`` are 0)."""

    data: str
    scales: str
    zero_points: str | None
    bits: int
    block_size: int
    minimums: str | None = None


class _Builder:
    """Collects nodes while walking the model's layers once; weights go to the store."""

    def __init__(self, model: PreTrainedModel, tensors, store: WeightStore, tie: bool,
                 bits: int | None, int8_compute: bool, token_ids: np.ndarray | None,
                 progress: Callable[[str], None],
                 eagle_fc: tuple[tuple[int, ...], torch.Tensor] | None = None,
                 block_size: int = QUANT_BLOCK_SIZE):
        self.block_size = block_size  # of the weights quantized here (``quantized``)
        self.model, self.config, self.tensors, self.store = model, model.config, tensors, store
        self.tie, self.bits, self.int8_compute = tie, bits, int8_compute
        self.token_ids, self.eagle_fc = token_ids, eagle_fc
        self.progress = progress
        self.nodes = []
        self.constants: set[str] = set()
        self.sums: dict[tuple[str, int], str] = {}  # block sums by (input, block size)

    # -- small helpers ------------------------------------------------------------------------

    def weight(self, name: str, value: torch.Tensor | np.ndarray, counted: bool = True) -> str:
        """A constant input; float tensors keep their stored type behind a Cast."""
        return self.store.add(name, value, self.nodes, counted)

    def constant(self, name: str, value: np.ndarray) -> str:
        """A small constant several nodes read, stored once."""
        if name not in self.constants:
            self.constants.add(name)
            self.weight(name, value)
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str] | int = 1, domain: str = "",
             **attrs) -> list[str]:
        from onnx import helper

        name = f"{op}_{len(self.nodes)}"
        if isinstance(outputs, int):
            outputs = [f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def linear(self, name: str, x: str, *modules: str) -> str:
        """x @ W^T (+ b) for one or several Linear layers (checkpoint names without
        ``.weight``) fused along the output axis."""
        names = [f"{m}.weight" for m in modules]
        packed = self.packed(names)
        parts = ([self.packed([n]) for n in names] if packed is None and len(names) > 1
                 else [None])
        if packed is not None:
            out = self.packed_matmul(f"{name}.weight", x, packed)
        elif any(part is not None for part in parts):  # blocks of different layouts, or some
            # read as floats (a Q4_K q|k beside a Q6_K v): one MatMul each, side by side
            outs = [self.packed_matmul(f"{name}.{i}.weight", x, part) if part is not None else
                    self.matmul(f"{name}.{i}.weight", x, self.tensors.read(n))
                    for i, (n, part) in enumerate(zip(names, parts))]
            (out,) = self.node("Concat", outs, axis=-1)
        else:
            w = torch.cat([self.tensors.read(f"{m}.weight") for m in modules])  # [out, in]
            out = self.matmul(f"{name}.weight", x, w)
        if f"{modules[0]}.bias" in self.tensors:
            b = torch.cat([self.tensors.read(f"{m}.bias") for m in modules])
            (out,) = self.node("Add", [out, self.weight(f"{name}.bias", b)])
        return out

    def matmul(self, name: str, x: str, w: torch.Tensor, output: str | None = None) -> str:
        """x @ w^T for w ``[N, K]`` as a checkpoint stores it: a MatMul with w^T, or a
        MatMulNBits with w's blocks (named as onnxruntime's quantizer names them)."""
        outputs = [output] if output else 1
        if not self.bits:
            (out,) = self.node("MatMul", [x, self.weight(name, w.T)], outputs=outputs)
            return out
        return self.matmul_nbits(x, self.quantized(name, w), *w.shape, outputs=outputs)

    def quantized(self, name: str, w: torch.Tensor, shape: tuple[int, ...] | None = None
                  ) -> _NBits:
        """w's blocks and scales stored as ``name``_Q<bits> (in ``shape`` if given) and
        ``name``_scales."""
        packed, scales = quantize_blocks(w, self.bits, block_size=self.block_size)
        if shape:
            packed = packed.reshape(shape)
        return _NBits(self.weight(f"{name}_Q{self.bits}", packed, counted=False),
                      self.weight(f"{name}_scales", scales, counted=False), None, self.bits,
                      self.block_size)

    def packed(self, names: list[str]):
        """The source's own blocks of these weights (export/gguf.py's Packed), or None: blocks
        wider than ``bits`` are read as floats and quantized to ``bits`` (a GGUF draft asked to
        be int4: its Q5_0/Q8_0 blocks made 4-bit, half the bytes a step reads)."""
        hand_over = getattr(self.tensors, "packed", None)
        widths = tuple(w for w in (4, 8) if not self.bits or w <= self.bits)
        return hand_over(names, widths) if hand_over else None

    def packed_matmul(self, name: str, x: str, packed, outputs: list[str] | int = 1) -> str:
        """x @ W^T from a source's blocks: a MatMulNBits, except 8-bit blocks in float compute.

        onnxruntime's CPU MatMulNBits has no float-compute kernel for 8-bit weights: it
        dequantizes the whole matrix on every run (two orders of magnitude slower than a
        MatMul). There the blocks are stored as they are and dequantized when the graph loads
        (``folded``): the package keeps the file's size, the session computes as float."""
        if packed.bits == 8 and not self.int8_compute:
            (out,) = self.node("MatMul", [x, self.folded(name, packed)], outputs=outputs)
            return out
        return self.matmul_nbits(x, self.store_packed(name, packed), *packed.shape,
                                 outputs=outputs)

    def folded(self, name: str, packed) -> str:
        """W^T ``[K, N]`` in float32, made from the stored blocks when the graph loads:
        scale * (q - 128), or scale * q + minimum, the products in the order llama.cpp's
        dequantization takes them (gguf_blocks.Packed.dequantize)."""
        n, k = packed.shape
        lows = packed.minimum_parts
        recipe = {"op": "dequantize", "values": _values(packed),
                  "scales": _factors(packed.scale_parts),
                  "minimums": None if lows is None else _factors(lows),
                  "zero": 0 if lows is not None else 1 << (packed.bits - 1)}
        return self.store.add_unpacked(f"{name}.folded", {"op": "transpose", "of": recipe},
                                       np.float32, (k, n))

    def store_packed(self, name: str, packed) -> _NBits:
        """A source's blocks stored in about the file's bytes (``name``_Q<bits>, _scales,
        _minimums transposed to [B, N], zero points 0 for blocks with minimums), the tensors
        MatMulNBits reads made from them when the graph loads (runtime/unpack.py)."""
        lows = None
        n, blocks = packed.data.shape[:2]
        if packed.minimum_parts is not None:
            lows = self.store.add_unpacked(
                f"{name}_minimums", {"op": "transpose", "of": _factors(packed.minimum_parts)},
                np.float32, (blocks, n))
        if packed.value_bits is None:
            data = self.weight(f"{name}_Q{packed.bits}", packed.data, counted=False)
        else:
            data = self.store.add_unpacked(f"{name}_Q{packed.bits}", _values(packed),
                                           np.uint8, packed.data.shape)
        scales = self.store.add_unpacked(f"{name}_scales", _factors(packed.scale_parts),
                                         np.float32, (n, blocks))
        return _NBits(data, scales, None, packed.bits, packed.block_size, lows)

    def zero_points(self, weight: _NBits, n: int, k: int) -> str | None:
        """Zero points 0 for MatMulNBits blocks with minimums (made at load: a graph keeps no
        initializer it does not read, so a table only gathered has none)."""
        if weight.zero_points or not weight.minimums:
            return weight.zero_points
        name = f"{weight.scales}.zero_points"
        if name not in self.constants:
            self.constants.add(name)
            columns = -(-(k // weight.block_size) * weight.bits // 8)  # packed as the weights
            self.store.add_unpacked(name, {"op": "zeros", "shape": [n, columns]}, np.uint8,
                                    (n, columns))
        return name

    def matmul_nbits(self, x: str, weight: _NBits, n: int, k: int,
                     outputs: list[str] | int = 1) -> str:
        """x @ W^T from W's blocks; with minimums, + (x's block sums) @ minimums, which is
        sum_k x_k (scale q_k + minimum) summed block by block (llama.cpp's Q4_1 dot product)."""
        level = {"accuracy_level": INT8_COMPUTE} if self.int8_compute else {}
        zero = self.zero_points(weight, n, k)
        inputs = [x, weight.data, weight.scales] + ([zero] if zero else [])
        final = outputs
        if weight.minimums:
            outputs = 1
        (out,) = self.node("MatMulNBits", inputs, outputs=outputs, domain=_MS, K=k, N=n,
                           bits=weight.bits, block_size=weight.block_size, **level)
        if not weight.minimums:
            return out
        (offset,) = self.node("MatMul", [self.block_sums(x, k, weight.block_size),
                                         weight.minimums])  # [1, S, N]
        (out,) = self.node("Add", [out, offset], outputs=final)
        return out

    def block_sums(self, x: str, k: int, size: int) -> str:
        """x's sums over blocks of ``size`` ``[1, S, K / size]``, made once per input (q, k
        and v, gate and up read the same x). A small K: one MatMul with a [K, K / size]
        matrix of ones on its block diagonal (products by 1 and 0 are exact; one node where
        Reshape + ReduceSum are two); a large one (an MLP's down projection: 10 MB of ones
        read every step at K = 8,960) Reshape + ReduceSum."""
        key = (x, size)
        if key not in self.sums:
            if k * (k // size) * 4 <= ONES_BYTES:
                ones = np.kron(np.eye(k // size, dtype=np.float32), np.ones((size, 1), np.float32))
                (sums,) = self.node("MatMul", [x, self.constant(f"block_sums.{k}x{size}",
                                                                 ones)])
            else:
                (blocks,) = self.node("Reshape", [x, self.constant(
                    f"blocks.{k}x{size}", np.array([0, 0, k // size, size]))])
                (sums,) = self.node("ReduceSum", [blocks, self.constant(
                    "axis_last", np.array([-1]))], keepdims=0)
            self.sums[key] = sums
        return self.sums[key]

    def skip_norm(self, name: str, x: str, skip: str, norm: str) -> tuple[str, str]:
        """(RMSNorm(x + skip), x + skip); ``norm`` names the checkpoint's weight."""
        normed, _, _, total = self.node(
            "SkipSimplifiedLayerNormalization", [x, skip, self.norm_weight(name, norm)],
            outputs=4, domain=_MS, epsilon=float(self.eps),
        )
        return normed, total

    def norm(self, name: str, x: str, norm: str) -> str:
        """RMSNorm(x) over the last axis; ``norm`` names the checkpoint's weight."""
        (normed,) = self.node("SimplifiedLayerNormalization", [x, self.norm_weight(name, norm)],
                              axis=-1, epsilon=float(self.eps))
        return normed

    def norm_weight(self, name: str, norm: str) -> str:
        """An RMSNorm's scale: the stored weight, + 1 in float32 for Gemma (Gemma3RMSNorm
        multiplies by ``1.0 + weight.float()``)."""
        weight = self.tensors.read(norm)
        offset = norm_offset(self.config)
        return self.weight(name, weight.float() + offset if offset else weight)

    # -- the graph ----------------------------------------------------------------------------

    def build(self):
        from onnx import TensorProto, helper

        cfg = self.config
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        kv_heads, head_dim = cfg.num_key_value_heads, head_dim_of(cfg)
        layers = cfg.num_hidden_layers

        seqlens_k, total_len = self.attention_lengths()
        gemma = cfg.model_type in GEMMA
        rotary = self.rotary_caches(head_dim)
        local_rotary = (self.rotary_caches(head_dim, local_rope_config(cfg), ".local")
                        if any(layer_window(cfg, i) for i in range(layers)) else rotary)

        x, table = self.embedding()
        if gemma:  # Gemma3TextScaledWordEmbedding: rows * sqrt(hidden) in the table's type
            (x,) = self.node("Mul", [x, self.weight("embed_scale", np.array(
                embed_scale(cfg, self.embed_dtype), dtype=np.float32))])
        residual = None
        streams = []  # the residual stream entering each layer (Hugging Face's hidden_states)
        start = time.perf_counter()
        for i in range(layers):
            layer = f"model.layers.{i}"
            if residual is None:
                normed = self.norm(f"l{i}.in_norm", x, f"{layer}.input_layernorm.weight")
                residual = x
            else:
                normed, residual = self.skip_norm(f"l{i}.in_norm", x, residual,
                                                  f"{layer}.input_layernorm.weight")
            streams.append(residual)
            attn = f"{layer}.self_attn"
            qkv = self.linear(f"l{i}.qkv", normed, f"{attn}.q_proj", f"{attn}.k_proj",
                              f"{attn}.v_proj")
            qkv = self.qk_norm(i, qkv) if cfg.model_type in QK_NORM else [qkv, "", ""]
            cos, sin = local_rotary if layer_window(cfg, i) else rotary
            context = self.attention(i, qkv, seqlens_k, total_len, cos, sin)
            x = self.linear(f"l{i}.o", context, f"{attn}.o_proj")
            if gemma:  # a norm after attention, another before and after the MLP
                x = self.norm(f"l{i}.post_attn_norm", x,
                              f"{layer}.post_attention_layernorm.weight")
                normed, residual = self.skip_norm(f"l{i}.pre_ffn_norm", x, residual,
                                                  f"{layer}.pre_feedforward_layernorm.weight")
                x = self.mlp(i, normed, f"{layer}.mlp")
                x = self.norm(f"l{i}.post_ffn_norm", x,
                              f"{layer}.post_feedforward_layernorm.weight")
            else:
                normed, residual = self.skip_norm(f"l{i}.post_norm", x, residual,
                                                  f"{layer}.post_attention_layernorm.weight")
                x = self.mlp(i, normed, f"{layer}.mlp")
            trim()
            self.progress(f"layer {i + 1}/{layers} written: {self.store.written / 2**20:,.0f} MB, "
                          f"{time.perf_counter() - start:.0f} s")
        normed, _ = self.skip_norm("final_norm", x, residual, "model.norm.weight")
        self.lm_head(self.last_rows(normed), table)
        if self.eagle_fc is not None:
            self.eagle_features(streams)

        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "total_length"]),
            helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]),
        ]
        rows = cfg.vocab_size if self.token_ids is None else len(self.token_ids)
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 [1, "scored_length", rows])]
        if self.eagle_fc is not None:
            outputs.append(helper.make_tensor_value_info(
                EAGLE_FEATURES, TensorProto.FLOAT, [1, "sequence_length", cfg.hidden_size]))
        for i in range(layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                    [1, kv_heads, "past_length", head_dim]))
                outputs.append(helper.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, [1, kv_heads, "present_length", head_dim]))
        return helper.make_graph(self.nodes, "edgespec_fused_decoder", inputs, outputs,
                                 self.store.initializers)

    def last_rows(self, x: str) -> str:
        """x's last LOGITS_TO_KEEP rows (a graph input; 0: Slice from -0 keeps every row), the
        rows the output layer scores."""
        (start,) = self.node("Neg", [LOGITS_TO_KEEP])
        (out,) = self.node("Slice", [x, start, self.constant("int64_max", np.array(
            [np.iinfo(np.int64).max])), self.constant("axis_1", np.array([1]))])
        return out

    def eagle_features(self, streams: list[str]) -> None:
        """eagle_features = fc(cat(streams[a], streams[b], streams[c])) for the head's aux
        layers (a, b, c): an EAGLE-3 head's input, [1, S, h]."""
        layers, fc = self.eagle_fc
        (both,) = self.node("Concat", [streams[i] for i in layers], axis=-1)  # [1, S, 3h]
        self.matmul("eagle_fc", both, fc, output=EAGLE_FEATURES)

    def embedding(self) -> tuple[str, _NBits | tuple[str, ...]]:
        """The Gather of input_ids' rows, and the stored table a tied output layer reads.

        int4 (hidden a whole number of blocks): a GatherBlockQuantized over uint8 ``[V, H/2]``
        with its default zero point 8, the layout of MatMulNBits' blocks of the same table. A
        tied table is stored once, as the output layer's MatMulNBits weight ``[V, H/32, 16]``,
        and the Gather reads it through a Reshape. Otherwise the table in its stored type.
        A source's own blocks are stored and gathered as they are (``packed_embedding``).
        """
        packed = self.packed([EMBED])
        self.embed_dtype = torch.float32  # blocks: the reference dequantizes to float32
        if packed is not None:
            return self.packed_embedding(packed)
        table = self.tensors.read(EMBED)  # [V, H]
        self.embed_dtype = table.dtype
        vocab, hidden = table.shape
        if self.bits == 4 and hidden % self.block_size == 0:
            if self.tie:
                tied = self.quantized("lm_head", table)
                data, scales = tied.data, tied.scales
                (data,) = self.node("Reshape", [data, self.weight(
                    "tied.shape", np.array([vocab, hidden // 2]))], outputs=["tied.table"])
                (scales,) = self.node("Reshape", [scales, self.weight(
                    "tied.scale_shape", np.array([vocab, hidden // self.block_size]))],
                    outputs=["tied.scales"])
            else:
                data, scales = self.quantized("embed", table, shape=(vocab, hidden // 2))[:2]
                tied = ()
            (x,) = self.node("GatherBlockQuantized", [data, "input_ids", scales], domain=_MS,
                             block_size=self.block_size, gather_axis=0, quantize_axis=1)
            return x, tied  # bits: the default, 4 (onnxruntime < 1.23 refuses the attribute)
        if not self.tie:
            (x,) = self.node("Gather", [self.weight("embed", table), "input_ids"])
            return x, ()
        # tied: stored once as the output layer's MatMul weight [H, V] (onnxruntime's MatMul
        # over a constant [K, N] is faster for one row than Gemm reading [N, K] transposed), and
        # the lookup gathers its columns: [H, V] -> [H, 1, S] -> [1, S, H], the same numbers
        embed = self.weight("embed_t", table.T)
        (columns,) = self.node("Gather", [embed, "input_ids"], axis=1)
        (x,) = self.node("Transpose", [columns], perm=[1, 2, 0])
        return x, (embed,)

    def packed_embedding(self, packed) -> tuple[str, _NBits | tuple]:
        """The Gather of a source's blocks ``[V, H]``, stored once for a tied output layer too.

        4 bits without zero points, blocks of 32: GatherBlockQuantized (its default zero point
        8). Otherwise the rows are gathered and dequantized by plain operators, as MatMulNBits
        computes them, nibbles split with Div/Mod on int32.
        """
        from onnx import TensorProto

        vocab, hidden = packed.shape
        tie = is_tied(self.model) and self.token_ids is None
        if tie and packed.bits == 8 and not self.int8_compute:  # the output layer's folded
            # float weight [H, V] (packed_matmul), whose columns the lookup gathers
            embed = self.folded("lm_head", packed)
            (columns,) = self.node("Gather", [embed, "input_ids"], axis=1)
            (x,) = self.node("Transpose", [columns], perm=[1, 2, 0])
            return x, (embed,)
        table = self.store_packed("lm_head" if tie else "embed", packed)
        blocks, size = hidden // packed.block_size, packed.block_size
        if packed.bits == 4 and packed.minimums is None and size == QUANT_BLOCK_SIZE:
            (data,) = self.node("Reshape", [table.data, self.weight(
                "table.shape", np.array([vocab, hidden // 2]))])
            (x,) = self.node("GatherBlockQuantized", [data, "input_ids", table.scales],
                             domain=_MS, block_size=size, gather_axis=0, quantize_axis=1)
            return x, table if tie else ()
        last = self.constant("axis_last", np.array([-1]))
        (rows,) = self.node("Gather", [table.data, "input_ids"])  # [1, S, blocks, bytes]
        (q,) = self.node("Cast", [rows], to=TensorProto.INT32)
        if packed.bits == 4:
            sixteen = self.weight("sixteen", np.array(16, dtype=np.int32))
            (low,) = self.node("Mod", [q, sixteen])
            (high,) = self.node("Div", [q, sixteen])
            pair = [self.node("Unsqueeze", [v, last])[0] for v in (low, high)]
            (both,) = self.node("Concat", pair, axis=-1)  # [1, S, blocks, bytes, 2]
            (q,) = self.node("Reshape", [both, self.weight(
                "blocks.shape", np.array([0, 0, blocks, size]))])
        (q,) = self.node("Cast", [q], to=TensorProto.FLOAT)
        (scale,) = self.node("Gather", [table.scales, "input_ids"])
        (scale,) = self.node("Unsqueeze", [scale, last])
        if table.minimums:  # scale * q + minimum; the minimums are stored [blocks, V]
            (w,) = self.node("Mul", [q, scale])
            (low,) = self.node("Gather", [table.minimums, "input_ids"],
                               axis=1)  # [blocks, 1, S]
            (low,) = self.node("Transpose", [low], perm=[1, 2, 0])
            (low,) = self.node("Unsqueeze", [low, last])
            (w,) = self.node("Add", [w, low])
        else:  # scale * (q - 2^(bits-1))
            zero = self.weight("zero_point", np.array(1 << (packed.bits - 1), dtype=np.float32))
            (centered,) = self.node("Sub", [q, zero])
            (w,) = self.node("Mul", [centered, scale])
        (x,) = self.node("Reshape", [w, self.weight("hidden.shape", np.array([0, 0, hidden]))])
        return x, table if tie else ()

    def lm_head(self, normed: str, tied: _NBits | tuple[str, ...]) -> None:
        """logits = normed @ W^T. A tied W is the embedding's stored table: in int4 the same
        MatMulNBits bytes, in float the table stored transposed ([H, V]). With token_ids, W is
        the rows of those tokens only."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        cap = getattr(self.config, "final_logit_softcapping", None)
        logits = "logits.uncapped" if cap else "logits"
        self.scores(normed, tied, logits, hidden, vocab)
        if cap:  # Gemma3ForCausalLM: cap * tanh(logits / cap)
            scale = self.weight("softcap", np.array(cap, dtype=np.float32))
            (x,) = self.node("Div", [logits, scale])
            (x,) = self.node("Tanh", [x])
            self.node("Mul", [x, scale], outputs=["logits"])

    def scores(self, normed: str, tied: _NBits | tuple[str, ...], logits: str, hidden: int,
               vocab: int) -> None:
        """``logits`` = normed @ W^T (lm_head's cases)."""
        if isinstance(tied, _NBits):  # the embedding's blocks
            self.matmul_nbits(normed, tied, vocab, hidden, outputs=[logits])
            return
        if tied:  # the embedding's table, stored transposed: [H, V]
            self.node("MatMul", [normed, tied[0]], outputs=[logits])
            return
        name = EMBED if is_tied(self.model) else HEAD
        packed = self.packed([name])
        if packed is not None:
            if self.token_ids is not None:
                packed = packed.rows(self.token_ids)
            self.packed_matmul("lm_head", normed, packed, outputs=[logits])
            return
        weight = self.tensors.read(name)  # [V, hidden]
        if self.token_ids is not None:
            weight = weight[torch.from_numpy(self.token_ids.astype(np.int64))]  # [N, hidden]
        self.matmul("lm_head", normed, weight, output=logits)

    def qk_norm(self, i: int, qkv: str) -> list[str]:
        """[q, k, v] from packed q|k|v, q and k RMS-normalized head by head (Qwen3).

        Qwen3Attention.forward (transformers) applies ``q_norm`` / ``k_norm``, RMSNorms over
        head_dim with weights ``[head_dim]``, to every head of q and k and only then rotates
        them; GroupQueryAttention rotates what it is given, so the norm comes first here:
        ``[1, S, heads * D] -> [1, S, heads, D]``, SimplifiedLayerNormalization over the last
        axis, back to ``[1, S, heads * D]``. The order matters: the rotation turns each pair
        of dimensions (j, j + D/2) and leaves the RMS alone, so norm and rotation commute only
        when the weight is equal on both dimensions of every pair, which trained weights are not.
        """
        cfg, head_dim = self.config, head_dim_of(self.config)
        attn = f"model.layers.{i}.self_attn"
        q_size = cfg.num_attention_heads * head_dim
        kv_size = cfg.num_key_value_heads * head_dim
        q, k, v = self.node("Split", [qkv, self.constant(
            "qkv.split", np.array([q_size, kv_size, kv_size]))], outputs=3, axis=-1)
        heads = self.constant("heads.shape", np.array([0, 0, -1, head_dim]))
        joined = self.constant("joined.shape", np.array([0, 0, -1]))
        normed = []
        for name, x in (("q_norm", q), ("k_norm", k)):
            (x,) = self.node("Reshape", [x, heads])  # [1, S, heads, D]
            x = self.norm(f"l{i}.{name}", x, f"{attn}.{name}.weight")
            normed.append(self.node("Reshape", [x, joined])[0])  # [1, S, heads * D]
        return [*normed, v]

    def attention_lengths(self) -> tuple[str, str]:
        """GroupQueryAttention's lengths from attention_mask [1, total]: seqlens_k = (tokens
        covered after this run) - 1 and total_sequence_length = total, both int32."""
        from onnx import TensorProto

        (mask_sum,) = self.node("ReduceSum", ["attention_mask", self.weight("axis1", np.array([1]))],
                                keepdims=0)
        (total64,) = self.node("Sub", [mask_sum, self.weight("one64", np.array([1]))])
        (seqlens_k,) = self.node("Cast", [total64], to=TensorProto.INT32)
        (shape,) = self.node("Shape", ["attention_mask"])
        (total_len64,) = self.node("Gather", [shape, self.weight("idx1", np.array(1))], axis=0)
        (total_len,) = self.node("Cast", [total_len64], to=TensorProto.INT32)
        return seqlens_k, total_len

    def attention(self, i: int, qkv: list[str], seqlens_k: str, total_len: str, cos: str,
                  sin: str) -> str:
        """GroupQueryAttention on [q|k|v packed, "", ""] or [q, k, v]: rotary, causal,
        past + new -> present; a sliding layer attends to its window only.

        GroupQueryAttention's ``local_window_size`` W keeps the W last positions, the token's
        own included, as transformers' sliding window of W does (kv_idx > q_idx - W): checked
        against PyTorch past the window (tests/test_gemma3.py; W - 1 differs from the W-th
        position on). The cache keeps every position (the runtime rolls back by a length);
        only the mask slides."""
        cfg = self.config
        window = layer_window(cfg, i)
        local = {} if window is None else {"local_window_size": window}
        (context, _, _) = self.node(
            "GroupQueryAttention",
            [*qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             seqlens_k, total_len, cos, sin],
            outputs=[f"l{i}.attn", f"present.{i}.key", f"present.{i}.value"], domain=_MS,
            num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads, do_rotary=1,
            rotary_interleaved=0, scale=attention_scale(cfg), **local,
        )
        return context

    def mlp(self, i: int, x: str, mlp: str) -> str:
        """down(act(gate(x)) * up(x)), gate and up in one MatMul; act is SiLU, or for Gemma
        GELU's tanh approximation (``gelu_pytorch_tanh``: onnxruntime's FastGelu computes
        0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the same formula)."""
        gate_up = self.linear(f"l{i}.gate_up", x, f"{mlp}.gate_proj", f"{mlp}.up_proj")
        size = self.tensors.shape(f"{mlp}.gate_proj.weight")[0]
        gate, up = self.node("Split", [gate_up, self.weight(f"l{i}.split", np.array([size, size]))],
                             outputs=2, axis=-1)
        if self.config.model_type in GEMMA:
            (act,) = self.node("FastGelu", [gate], domain=_MS)
        else:
            (sig,) = self.node("Sigmoid", [gate])
            (act,) = self.node("Mul", [gate, sig])
        (act,) = self.node("Mul", [act, up])
        return self.linear(f"l{i}.down", act, f"{mlp}.down_proj")

    def rotary_caches(self, head_dim: int, config=None, name: str = "") -> tuple[str, str]:
        """cos/sin tables [max_positions, head_dim / 2], from the model's own rotary module
        (made afresh from ``config``, the model's by default: a skeleton's has no values).

        The module's output repeats each half (rotate-half layout); it already includes any
        static rope scaling of the checkpoint. A source of GGUF blocks stores the module's
        frequencies and makes the tables at load (runtime/unpack.py's "rotary"): Gemma 3's two
        rope bases over 32,768 positions are 64 MB of tables, a quarter of the 270M file.
        """
        config = config or self.config
        rotary = type(self.model.model.rotary_emb)(config=config)
        count = self.config.max_position_embeddings
        half = head_dim // 2
        if hasattr(self.tensors, "packed"):  # a GGUF-sized package: made when it loads
            frequencies = {"op": "part", "array": rotary.inv_freq.float().numpy()}  # [half]
            return tuple(self.store.add_unpacked(
                f"{fn}_cache{name}", {"op": "rotary", "frequencies": frequencies,
                                      "positions": count, "fn": fn,
                                      "scale": float(rotary.attention_scaling)},
                np.float32, (count, half)) for fn in ("cos", "sin"))
        positions = torch.arange(count)[None]  # [1, P]
        dummy = torch.zeros(1, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = rotary(dummy, positions)  # [1, P, head_dim]
        return (self.weight(f"cos_cache{name}", cos[0, :, :half].float()),
                self.weight(f"sin_cache{name}", sin[0, :, :half].float()))


def _values(packed) -> dict:
    """The recipe of 8-bit blocks ``[N, B, size]`` whose values take ``value_bits`` (5 or 6):
    the low 4 bits two a byte, the rest 8 / r a byte (runtime/unpack.py puts them together)."""
    if packed.value_bits is None:
        return {"op": "part", "array": packed.data}
    value = packed.data - np.uint8(packed.offset)  # [N, B, size]
    if value.max(initial=0) >> packed.value_bits:
        raise ExportError(f"blocks said to hold {packed.value_bits}-bit values hold larger "
                          "ones (an edgespec bug: please report it)")
    rest = packed.value_bits - 4
    shape = list(packed.data.shape)
    return {"op": "values", "offset": packed.offset,
            "low": {"op": "bits", "width": 4, "shape": shape,
                    "of": {"op": "part", "array": _pack_bits(value & 15, 4)}},
            "high": {"op": "bits", "width": rest, "shape": shape,
                     "of": {"op": "part", "array": _pack_bits(value >> 4, rest)}}}


def _factors(parts) -> dict:
    """The recipe of float32 scales or minimums ``[N, B]`` from the file's float16 units and
    6-bit steps (gguf_blocks.Factors)."""
    return {"op": "factors", "unit": {"op": "part", "array": parts.unit},
            "steps": None if parts.steps is None else {"op": "part", "array": parts.steps}}


def _pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """uint8 values below 2^width -> 8 / width a byte, the first in the least significant bits
    (runtime/unpack.py's "bits" undoes it)."""
    count = 8 // width
    groups = values.reshape(-1, count).astype(np.uint8)
    shifts = (width * np.arange(count)).astype(np.uint8)
    return np.bitwise_or.reduce(groups << shifts, axis=-1).astype(np.uint8)
