"""A fused ONNX graph for Llama-family decoders, written from the checkpoint's weights.

optimum's graph spells attention out in ~100 small ops a layer (shape arithmetic, rotary
slices, concatenating the cache), and each op costs dispatch time that dominates a small
model's decode step. This builder emits the few fused onnxruntime operators the model needs
(the approach of onnxruntime-genai's model builder; the graph here is written independently):

    Gather(embedding)
    per layer:  SkipSimplifiedLayerNormalization  (residual add + RMSNorm)
                MatMul(q|k|v fused)  -> GroupQueryAttention (rotary, causal, KV cache)
                MatMul(o)  -> SkipSimplifiedLayerNormalization
                MatMul(gate|up fused) -> SiLU(gate) * up -> MatMul(down)
    SkipSimplifiedLayerNormalization -> MatMul(lm_head) -> logits

Inputs and outputs keep the names of optimum's graph (input_ids, attention_mask,
past_key_values.i.key/value -> logits, present.i.key/value), so the runtime drives both alike.
GroupQueryAttention also accepts a preallocated cache bound as both past and present, which lets
the runtime append in place and roll back by changing a length (``runtime/session.py``).

Positions come from the attention mask (GroupQueryAttention rotates token j of a run at position
total_length - run_length + j), so the graph has no position_ids input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from edgespec.errors import ExportError
from edgespec.export.onnx_io import EXTERNAL_ABOVE, WeightStore, write_graph

SUPPORTED = ("llama", "mistral", "qwen2")
_MS = "com.microsoft"
_OPSET = 17


def why_not_fused(model: PreTrainedModel) -> str | None:
    """None if the builder handles this model, else the reason it does not."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"{config.model_type} is not a Llama-family model"
    scaling = getattr(config, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type")) in ("dynamic", "longrope"):
        return f"rope scaling {scaling} depends on the sequence length; not supported"
    head_dim = _head_dim(config)
    if head_dim % 16:
        return f"head size {head_dim} is not a multiple of 16 (GroupQueryAttention needs it)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not supported"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act} is not supported"
    return None


def build_fused_graph(model: PreTrainedModel, folder: Path, keep_precision: bool = True,
                      token_ids: np.ndarray | None = None) -> dict:
    """Write folder/model.onnx for a Llama-family ``model``; the graph computes in float32.

    keep_precision: store each weight in the checkpoint's own type (bf16 or fp16) with a Cast
        to float32 that onnxruntime folds when the session loads: the package is as large as
        the checkpoint and computes exactly as an fp32 upcast would. False stores float32, for
        the passes that rewrite weights afterwards (quantization, fp16 conversion).
    Weights go straight to disk as they are made (model.onnx_data for models over 1 GB), so the
    build needs little memory beyond the model itself. Returns the number of weights per stored
    type.
    """
    reason = why_not_fused(model)
    if reason:
        raise ExportError(f"cannot build a fused graph: {reason}; use --graph optimum")
    folder.mkdir(parents=True)
    tied = is_tied(model)
    tie = keep_precision and tied and token_ids is None
    stored_bytes = sum(p.numel() * (p.element_size() if keep_precision else 4)
                       for p in model.parameters())
    if tied and not tie:  # the output layer gets its own copy of the table (or of its rows)
        rows = len(token_ids) if token_ids is not None else model.config.vocab_size
        stored_bytes += rows * model.config.hidden_size * 4
    with WeightStore(folder, external=stored_bytes > EXTERNAL_ABOVE,
                     keep_precision=keep_precision) as store:
        graph = _Builder(model, store, tie=tie, token_ids=token_ids).build()
    write_graph(graph, folder, [("", _OPSET), (_MS, 1)])
    return store.counts


def is_tied(model: PreTrainedModel) -> bool:
    """Whether lm_head is the embedding table itself (then it is stored once)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Builder:
    """Collects nodes while walking the model's layers once; weights go to the store."""

    def __init__(self, model: PreTrainedModel, store: WeightStore, tie: bool,
                 token_ids: np.ndarray | None = None):
        self.model, self.config, self.store, self.tie = model, model.config, store, tie
        self.token_ids = token_ids
        self.nodes = []

    # -- small helpers ------------------------------------------------------------------------

    def weight(self, name: str, value: torch.Tensor | np.ndarray) -> str:
        """A constant input; float tensors keep their stored type behind a Cast."""
        return self.store.add(name, value, self.nodes)

    def node(self, op: str, inputs: list[str], outputs: list[str] | int = 1, domain: str = "",
             **attrs) -> list[str]:
        from onnx import helper

        name = f"{op}_{len(self.nodes)}"
        if isinstance(outputs, int):
            outputs = [f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def linear(self, name: str, x: str, *modules: torch.nn.Linear) -> str:
        """x @ W^T (+ b) for one or several Linear layers fused along the output axis."""
        w = torch.cat([m.weight.detach().T for m in modules], dim=1)  # [in, out]
        (out,) = self.node("MatMul", [x, self.weight(f"{name}.weight", w)])
        if modules[0].bias is not None:
            b = torch.cat([m.bias.detach() for m in modules])
            (out,) = self.node("Add", [out, self.weight(f"{name}.bias", b)])
        return out

    def skip_norm(self, name: str, x: str, skip: str, norm) -> tuple[str, str]:
        """(RMSNorm(x + skip), x + skip)."""
        normed, _, _, total = self.node(
            "SkipSimplifiedLayerNormalization", [x, skip, self.weight(name, norm.weight)],
            outputs=4, domain=_MS, epsilon=float(self.eps),
        )
        return normed, total

    # -- the graph ----------------------------------------------------------------------------

    def build(self):
        from onnx import TensorProto, helper

        cfg, inner = self.config, self.model.model
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        kv_heads, head_dim, layers = cfg.num_key_value_heads, _head_dim(cfg), len(inner.layers)

        # seqlens_k = (tokens covered after this run) - 1; total = that count, both int32
        (mask_sum,) = self.node("ReduceSum", ["attention_mask", self.weight("axis1", np.array([1]))],
                                keepdims=0)
        (total64,) = self.node("Sub", [mask_sum, self.weight("one64", np.array([1]))])
        (seqlens_k,) = self.node("Cast", [total64], to=TensorProto.INT32)
        (shape,) = self.node("Shape", ["attention_mask"])
        (total_len64,) = self.node("Gather", [shape, self.weight("idx1", np.array(1))], axis=0)
        (total_len,) = self.node("Cast", [total_len64], to=TensorProto.INT32)
        cos, sin = self.rotary_caches(head_dim)

        embed = self.weight("embed", inner.embed_tokens.weight)
        (x,) = self.node("Gather", [embed, "input_ids"])
        residual = None
        for i, layer in enumerate(inner.layers):
            if residual is None:
                (normed,) = self.node(
                    "SimplifiedLayerNormalization",
                    [x, self.weight(f"l{i}.in_norm", layer.input_layernorm.weight)],
                    axis=-1, epsilon=float(self.eps),
                )
                residual = x
            else:
                normed, residual = self.skip_norm(f"l{i}.in_norm", x, residual,
                                                  layer.input_layernorm)
            attn = layer.self_attn
            qkv = self.linear(f"l{i}.qkv", normed, attn.q_proj, attn.k_proj, attn.v_proj)
            context = self.attention(i, qkv, seqlens_k, total_len, cos, sin)
            x = self.linear(f"l{i}.o", context, attn.o_proj)
            normed, residual = self.skip_norm(f"l{i}.post_norm", x, residual,
                                              layer.post_attention_layernorm)
            x = self.mlp(i, normed, layer.mlp)
        normed, _ = self.skip_norm("final_norm", x, residual, inner.norm)
        self.lm_head(normed, embed)

        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "total_length"]),
        ]
        rows = cfg.vocab_size if self.token_ids is None else len(self.token_ids)
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 [1, "sequence_length", rows])]
        for i in range(layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                    [1, kv_heads, "past_length", head_dim]))
                outputs.append(helper.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, [1, kv_heads, "present_length", head_dim]))
        return helper.make_graph(self.nodes, "edgespec_fused_decoder", inputs, outputs,
                                 self.store.initializers)

    def lm_head(self, normed: str, embed: str) -> None:
        """logits = normed @ W^T; a tied W is the embedding table, read transposed by Gemm.
        With token_ids, W is the rows of those tokens only."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        if not self.tie:
            weight = self.model.get_output_embeddings().weight.detach()  # [V, hidden]
            if self.token_ids is not None:
                weight = weight[torch.from_numpy(self.token_ids)]  # [N, hidden]
            head = weight.T  # [hidden, V or N]
            self.node("MatMul", [normed, self.weight("lm_head", head)], outputs=["logits"])
            return
        (rows,) = self.node("Reshape", [normed, self.weight("rows", np.array([-1, hidden]))])
        (flat,) = self.node("Gemm", [rows, embed], transB=1)  # [n, V]
        self.node("Reshape", [flat, self.weight("logits_shape", np.array([1, -1, vocab]))],
                  outputs=["logits"])

    def attention(self, i: int, qkv: str, seqlens_k: str, total_len: str, cos: str,
                  sin: str) -> str:
        """GroupQueryAttention on packed q|k|v: rotary, causal, past + new -> present."""
        cfg = self.config
        head_dim = _head_dim(cfg)
        (context, _, _) = self.node(
            "GroupQueryAttention",
            [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             seqlens_k, total_len, cos, sin],
            outputs=[f"l{i}.attn", f"present.{i}.key", f"present.{i}.value"], domain=_MS,
            num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads, do_rotary=1,
            rotary_interleaved=0, scale=float(head_dim**-0.5),
        )
        return context

    def mlp(self, i: int, x: str, mlp) -> str:
        """down(SiLU(gate(x)) * up(x)), gate and up in one MatMul."""
        gate_up = self.linear(f"l{i}.gate_up", x, mlp.gate_proj, mlp.up_proj)
        size = mlp.gate_proj.out_features
        gate, up = self.node("Split", [gate_up, self.weight(f"l{i}.split", np.array([size, size]))],
                             outputs=2, axis=-1)
        (sig,) = self.node("Sigmoid", [gate])
        (silu,) = self.node("Mul", [gate, sig])
        (act,) = self.node("Mul", [silu, up])
        return self.linear(f"l{i}.down", act, mlp.down_proj)

    def rotary_caches(self, head_dim: int) -> tuple[str, str]:
        """cos/sin tables [max_positions, head_dim / 2], from the model's own rotary module.

        The module's output repeats each half (rotate-half layout); it already includes any
        static rope scaling of the checkpoint.
        """
        positions = torch.arange(self.config.max_position_embeddings)[None]  # [1, P]
        dummy = torch.zeros(1, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(dummy, positions)  # [1, P, head_dim]
        half = head_dim // 2
        return (self.weight("cos_cache", cos[0, :, :half].float()),
                self.weight("sin_cache", sin[0, :, :half].float()))
