"""One exported decoder graph on onnxruntime: feeds built from the cache, logits out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.errors import ManifestError
from edgespec.manifest import ModelSpec
from edgespec.runtime.kv_cache import InPlaceKVCache, KVCache
from edgespec.runtime.providers import SessionConfig, fallback_warning, provider_chain

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class ModelSession:
    """An onnxruntime session for one decoder with KV cache inputs and outputs.

    The KV input and output names, head count and head size are read from the graph and checked
    against the manifest, so any layer count or architecture optimum exports works. Fused
    graphs (export/fused.py) update a preallocated cache of ``max_positions`` in place;
    optimum's graphs return a new, longer cache each run.
    """

    def __init__(
        self, path: Path, spec: ModelSpec, vocab_size: int, max_positions: int, config: SessionConfig
    ):
        chain, warning = provider_chain(config)
        options = ort.SessionOptions()
        options.intra_op_num_threads = config.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spin else "0")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=chain)
        except Exception as e:  # onnxruntime raises its own untyped errors for bad files
            raise ManifestError(f"cannot load {path}: {e}; re-export the pair") from None
        self.providers = self.session.get_providers()
        self.warning = warning or fallback_warning(chain, self.providers)
        self.vocab_size = vocab_size
        self._read_graph(spec)
        self.in_place = spec.graph == "fused"
        self.max_positions = max_positions
        self.device = "cuda" if self.providers[0] != "CPUExecutionProvider" else "cpu"

    def _read_graph(self, spec: ModelSpec) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.kv_inputs = [n for n in inputs if n.startswith("past_key_values.")]
        self.kv_outputs = [n for n in outputs if n.startswith("present.")]
        if self.kv_inputs != spec.kv_inputs or self.kv_outputs != spec.kv_outputs:
            raise ManifestError(f"{spec.path}: KV names differ from the manifest; re-export the pair")
        first = inputs[self.kv_inputs[0]]
        self.kv_heads, self.head_dim = first.shape[1], first.shape[3]
        self.kv_dtype = _ORT_DTYPES[first.type]
        self.has_position_ids = "position_ids" in inputs
        self.has_attention_mask = "attention_mask" in inputs
        self.output_names = ["logits", *self.kv_outputs]

    def new_cache(self) -> KVCache | InPlaceKVCache:
        if self.in_place:
            return InPlaceKVCache(self.kv_inputs, self.kv_heads, self.head_dim,
                                  self.max_positions, self.kv_dtype, self.device)
        return KVCache(self.kv_inputs, self.kv_heads, self.head_dim, self.kv_dtype)

    def forward(self, tokens: np.ndarray, cache: KVCache | InPlaceKVCache) -> np.ndarray:
        """Run ``tokens [n]`` after what the cache covers; returns logits ``[n, vocab]``.

        position_ids and attention_mask are derived from the cache length; the cache then
        covers the fed tokens too.
        """
        start, n = cache.length, len(tokens)
        feeds = {"input_ids": np.asarray(tokens, dtype=np.int64)[None, :]}
        if self.has_attention_mask:
            feeds["attention_mask"] = np.ones((1, start + n), dtype=np.int64)
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(start, start + n, dtype=np.int64)[None, :]
        if self.in_place:
            cache.check_room(n)
            logits = self._run_in_place(feeds, cache)
            cache.advance(n)
        else:
            logits, *presents = self.session.run(self.output_names, {**feeds, **cache.feeds()})
            cache.replace(presents, added=n)
        return logits[0, :, : self.vocab_size]  # [n, V]; padded rows dropped

    def _run_in_place(self, feeds: dict[str, np.ndarray], cache: InPlaceKVCache) -> np.ndarray:
        """One run with each KV buffer bound as both past input and present output."""
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # first bound output: get_outputs()[0]
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for past, present, buffer in zip(self.kv_inputs, self.kv_outputs, cache.buffers):
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()
