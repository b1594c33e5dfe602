"""An EAGLE-3 head as an ONNX graph (the package's third graph), and its check against the
PyTorch reference (export/eagle3.py).

The graph is the fused builder's (export/fused.py) operators for one layer, fed differently:

    inputs   input_ids [1, S], eagle_features [1, S, h] (the target graph's output of that
             name: fc of its three aux streams), attention_mask [1, T],
             past_key_values.0.key/value [1, kv_heads, P, head_dim]
    z        = Concat(RMSNorm_in(Gather(embedding, input_ids)), RMSNorm_hidden(eagle_features))
             -> MatMul(q|k|v) -> GroupQueryAttention (rotary, causal, KV cache) -> MatMul(o)
    r        = SkipSimplifiedLayerNormalization(o, eagle_features)  (residual: the un-normed g;
             RMSNorm_hidden(g) for a head with norm_before_residual)
             -> MatMul(gate|up) -> SiLU * up -> MatMul(down) -> Skip...Norm(down, r)
    outputs  logits [1, S, draft_vocab], hidden_out [1, S, h] (the residual after the MLP,
             fed back as the next row's eagle_features while drafting), present.0.key/value

Positions come from the attention mask as in the target's graph: row j of a run is rotated at
``T - S + j``, the head's cache length plus j, so a head whose cache covers rows 0..j-1 runs
row j at position j (the position of the target feature it reads) with no position input.
The embedding table is the target's, stored again in the head graph (int4 when the head is
quantized int4: the cost is the table's bytes once more on disk, and no extra compute).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgespec.errors import ExportError
from edgespec.export.eagle3 import Eagle3Head, HeadConfig, HeadTensors
from edgespec.export.fused import _MS, _OPSET, EAGLE_FEATURES, EMBED, _Builder
from edgespec.export.onnx_io import EXTERNAL_ABOVE, WeightStore, write_graph
from edgespec.export.precision import QUANT_BLOCK_SIZE
from edgespec.manifest import ModelSpec
from edgespec.manifest import HIDDEN_OUT, LOGITS_TO_KEEP

HEAD_TOLERANCE = 1e-3  # max |logit difference| of a float32 head graph against PyTorch


class _HeadTensors:
    """The head's weights under their own names, and the target's embedding table."""

    def __init__(self, head: HeadTensors, target):
        self.head, self.target = head, target

    def _source(self, name: str):
        return self.target if name == EMBED else self.head

    def __contains__(self, name: str) -> bool:
        return name in self._source(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._source(name).shape(name))

    def read(self, name: str) -> torch.Tensor:
        return self._source(name).read(name)


class _HeadBuilder(_Builder):
    """The fused builder's helpers, writing the head's one layer."""

    def __init__(self, config: HeadConfig, tensors: _HeadTensors, store: WeightStore,
                 bits: int | None, int8_compute: bool):
        # the fields the inherited helpers read, set here: _Builder's own __init__ wants a
        # transformers model, which a head is not (no tying, no rotary module, no layers)
        self.head_config = config
        self.config = config.llama_config()
        self.model = None
        self.tensors, self.store = tensors, store
        self.tie, self.bits, self.int8_compute = False, bits, int8_compute
        self.block_size = QUANT_BLOCK_SIZE
        self.token_ids, self.eagle_fc = None, None
        self.progress = lambda line: None
        self.nodes, self.constants = [], set()

    def norm(self, name: str, x: str, weight: str) -> str:
        (out,) = self.node("SimplifiedLayerNormalization",
                           [x, self.weight(name, self.tensors.read(weight))], axis=-1,
                           epsilon=float(self.eps))
        return out

    def rotary_caches(self, head_dim: int) -> tuple[str, str]:
        """cos/sin ``[max_positions, head_dim / 2]`` from transformers' Llama rotary module
        made from the head's config (its rope_theta and scaling)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config=self.config)
        positions = torch.arange(self.config.max_position_embeddings)[None]
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1), positions)
        half = head_dim // 2
        return (self.weight("cos_cache", cos[0, :, :half].float()),
                self.weight("sin_cache", sin[0, :, :half].float()))

    def build(self):
        from onnx import TensorProto, helper

        head = self.head_config
        self.eps = head.eps
        seqlens_k, total_len = self.attention_lengths()
        cos, sin = self.rotary_caches(head.head_dim)

        embedded, _ = self.embedding()
        hidden = self.norm("hidden_norm", EAGLE_FEATURES, "midlayer.hidden_norm.weight")
        (z,) = self.node("Concat", [
            self.norm("in_norm", embedded, "midlayer.input_layernorm.weight"), hidden], axis=-1)
        attn = "midlayer.self_attn"
        qkv = self.linear("l0.qkv", z, f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")
        context = self.attention(0, [qkv, "", ""], seqlens_k, total_len, cos, sin)  # packed
        o = self.linear("l0.o", context, f"{attn}.o_proj")
        residual = hidden if head.norm_before_residual else EAGLE_FEATURES
        normed, r = self.skip_norm("l0.post_norm", o, residual,
                                   "midlayer.post_attention_layernorm.weight")
        down = self.mlp(0, normed, "midlayer.mlp")
        normed, r = self.skip_norm("final_norm", down, r, "norm.weight")
        self.node("Identity", [r], outputs=[HIDDEN_OUT])
        self.matmul("lm_head", normed, self.tensors.read("lm_head.weight"), output="logits")

        shape = [1, "sequence_length"]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, shape),
            helper.make_tensor_value_info(EAGLE_FEATURES, TensorProto.FLOAT, [*shape, head.hidden]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "total_length"]),
        ]
        outputs = [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*shape, head.draft_vocab]),
            helper.make_tensor_value_info(HIDDEN_OUT, TensorProto.FLOAT, [*shape, head.hidden]),
        ]
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_key_values.0.{kind}", TensorProto.FLOAT,
                [1, head.kv_heads, "past_length", head.head_dim]))
            outputs.append(helper.make_tensor_value_info(
                f"present.0.{kind}", TensorProto.FLOAT,
                [1, head.kv_heads, "present_length", head.head_dim]))
        return helper.make_graph(self.nodes, "edgespec_eagle3_head", inputs, outputs,
                                 self.store.initializers)


def build_head_graph(config: HeadConfig, head: HeadTensors, target_tensors, folder: Path,
                     bits: int | None = None, int8_compute: bool = False) -> dict:
    """Write folder/model.onnx for an EAGLE-3 head; the graph computes in float32.

    target_tensors: the target's weights (export/tensors.py): its embedding table is read.
    bits: 4 or 8 quantizes every MatMul (and in int4 the embedding) as the fused builder does;
    int8_compute: those MatMuls compute with int8 activations (as a quantized draft's do: its
    precision moves only acceptance, never the output).
    Returns the number of float weights per stored type.
    """
    if config.head_dim % 16:
        raise ExportError(f"{config.path}: head size {config.head_dim} is not a multiple of 16 "
                          "(GroupQueryAttention needs it)")
    if bits == 4 and config.hidden % QUANT_BLOCK_SIZE:
        raise ExportError(f"{config.path}: hidden size {config.hidden} is not a multiple of "
                          f"{QUANT_BLOCK_SIZE}; export the head without int4")
    folder.mkdir(parents=True)
    tensors = _HeadTensors(head, target_tensors)
    table = int(np.prod(target_tensors.shape(EMBED))) * 4
    external = head.nbytes + table > EXTERNAL_ABOVE
    with WeightStore(folder, external=external, keep_precision=True) as store:
        graph = _HeadBuilder(config, tensors, store, bits, int8_compute).build()
    write_graph(graph, folder, [("", _OPSET), (_MS, 1)])
    return store.counts


def export_head(config: HeadConfig, target_tensors, root: Path, variant: str, validation: str,
                detail) -> ModelSpec:
    """The head's graph in ``root``/draft, its target ids, and its ModelSpec (architecture
    "eagle3", ``token_ids``: the target id of each logits column, as a subset draft's).

    Validated (unless ``validation`` is "skip") on the target graph's own eagle_features for
    the validation text (root/target, written first) against the PyTorch reference: a float
    head within HEAD_TOLERANCE ("strict" refuses more, "report" records it); a quantized one
    is recorded (its logits move with its weights).
    """
    from dataclasses import replace

    from edgespec.export.graph import describe_graph
    from edgespec.export.vocab import TOKEN_IDS_NAME

    tensors = HeadTensors(config)
    ids = tensors.target_ids(config)
    if (np.diff(ids) <= 0).any():
        raise ExportError(f"{config.path}: d2t's target ids are not ascending; edgespec reads "
                          "heads whose draft vocabulary keeps the target's order")
    bits = int(variant[3:]) if variant in ("int4", "int8") else None
    folder = root / "draft"
    detail(f"writing the EAGLE-3 head's graph ({variant}; draft vocabulary "
           f"{config.draft_vocab:,} of {config.vocab:,})")
    stored = build_head_graph(config, tensors, target_tensors, folder, bits,
                              int8_compute=bits is not None)
    np.save(folder / TOKEN_IDS_NAME, ids)
    parameters = sum(int(np.prod(tensors.shape(n))) for n in Eagle3Head.weight_names())
    spec = replace(describe_graph(folder, root, "eagle3", parameters), graph="fused",
                   stored=dict(stored), quantization=variant if bits else None,
                   compute="int8" if bits else "float",
                   token_ids=f"draft/{TOKEN_IDS_NAME}")
    if validation == "skip":
        return replace(spec, validation={"variant": variant, "skipped": True})
    sample = np.random.default_rng(0).integers(0, config.vocab, 24)
    features = target_features(root / "target" / "model.onnx", sample)
    reference = Eagle3Head.load(config, tensors, target_tensors.read(EMBED))
    tolerance = HEAD_TOLERANCE if bits is None else float("inf")
    try:
        figures = validate_head(folder / "model.onnx", reference, sample, features, tolerance)
        failures = []
    except ExportError as e:
        if validation == "strict":
            raise
        figures, failures = {}, [str(e)]
    detail(f"head against PyTorch: {figures or failures}")
    return replace(spec, validation={"variant": variant, **figures, "failures": failures,
                                     "reference": "PyTorch (export/eagle3.py) on the target "
                                                  "graph's eagle_features"})


def target_features(path: Path, ids: np.ndarray) -> np.ndarray:
    """A fused target graph's eagle_features ``[s, h]`` for ``ids`` ``[s]`` (one run)."""
    from edgespec.runtime.loader import inference_session

    session = inference_session(path)  # a GGUF target's blocks are made at load
    feeds = {"input_ids": ids[None].astype(np.int64),
             "attention_mask": np.ones((1, len(ids)), np.int64),
             LOGITS_TO_KEEP: np.ones(1, np.int64)}  # the features only: one row of logits
    for arg in session.get_inputs():
        if arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
    (features,) = session.run([EAGLE_FEATURES], feeds)
    return features[0]


def head_run(session, ids: np.ndarray, features: np.ndarray, past: tuple[np.ndarray, np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One plain onnxruntime run of a head graph (no IO binding): ids ``[s]``, features
    ``[s, h]`` after ``past`` (key, value); (logits ``[s, dv]``, hidden_out ``[s, h]``, the
    new past)."""
    n = past[0].shape[2] + len(ids)
    logits, hidden, key, value = session.run(
        ["logits", HIDDEN_OUT, "present.0.key", "present.0.value"],
        {"input_ids": ids[None].astype(np.int64), EAGLE_FEATURES: features[None].astype(np.float32),
         "attention_mask": np.ones((1, n), np.int64),
         "past_key_values.0.key": past[0], "past_key_values.0.value": past[1]})
    return logits[0], hidden[0], (key, value)


def validate_head(path: Path, reference: Eagle3Head, ids: np.ndarray, features: np.ndarray,
                  tolerance: float = HEAD_TOLERANCE) -> dict:
    """Run the head graph at ``path`` on ``ids`` ``[s]`` and ``features`` ``[s, h]`` in two
    runs (the second through the first's cache, as drafting does) and compare its logits and
    hidden_out with the PyTorch reference's over one run; ExportError above ``tolerance``.
    Returns the figures: max |difference| of logits and of hidden_out."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = reference.config
    empty = np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32)
    half = len(ids) // 2
    first = head_run(session, ids[:half], features[:half], (empty, empty))
    second = head_run(session, ids[half:], features[half:], first[2])
    logits, hidden = np.concatenate([first[0], second[0]]), np.concatenate([first[1], second[1]])
    expected = reference(torch.from_numpy(ids)[None], torch.from_numpy(features)[None],
                         torch.arange(len(ids))[None])
    reference_logits = expected[0][0].numpy()
    figures = {"max_abs_logits": float(np.abs(logits - reference_logits).max()),
               "max_abs_hidden": float(np.abs(hidden - expected[1][0].numpy()).max()),
               "top1_agreement": float((logits.argmax(-1) == reference_logits.argmax(-1)).mean())}
    if max(figures["max_abs_logits"], figures["max_abs_hidden"]) > tolerance:
        raise ExportError(f"{path}: the head graph differs from PyTorch by {figures} (tolerance "
                          f"{tolerance}); please report it")
    return figures
