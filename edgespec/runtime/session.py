"""One exported decoder graph on onnxruntime: feeds built from the cache, logits out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.errors import ManifestError
from edgespec.manifest import FEATURES, HIDDEN_OUT, LOGITS_TO_KEEP, ModelSpec
from edgespec.runtime import loader
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.runtime.package_checks import check_graph_io, check_probe_run
from edgespec.runtime.providers import (
    SessionConfig,
    fallback_warning,
    on_shared_pool,
    provider_chain,
)

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
INITIAL_POSITIONS = 256  # an in-place cache's first size when no request length is given
# The run sizes whose reads decide which made tensors the load may let go (``_probe``): a lone
# token and a verify-sized run take different kernels, whatever min_run_tokens says (a manifest
# may be wrong for this CPU, and the load's own checks run lone tokens)
PROBE_RUNS = (1, 2, 9)
# onnxruntime's refusal of a session's own pool in a process with global pools
GLOBAL_POOLS_ONLY = "use_per_session_threads must be false"


class ModelSession:
    """An onnxruntime session for one decoder with KV cache inputs and outputs.

    The KV input and output names, head count and head size are read from the graph and checked
    against the manifest, so any layer count or architecture optimum exports works. Fused
    graphs (export/fused.py) update a preallocated cache in place, sized to the request and
    grown up to ``max_positions``; optimum's graphs return a new, longer cache each run.
    """

    def __init__(
        self, path: Path, spec: ModelSpec, vocab_size: int, max_positions: int, config: SessionConfig,
        token_ids: np.ndarray | None = None,
    ):
        chain, warning = provider_chain(config)
        # onnxruntime's own log is silenced (process-wide, FATAL only): every error it logs is
        # also raised, or, for a provider that could not start, named in self.warning. Its
        # ~12 lines per model of library-loading errors buried edgespec's one-line warning.
        ort.set_default_logger_severity(4)
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.intra_op_num_threads = config.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spin else "0")
        # the process's one pool where asked, or where it exists (providers.on_shared_pool)
        self.shared_pool = on_shared_pool(config)
        if self.shared_pool:  # not an option in onnxruntime 1.22 (nor are global pools)
            options.use_per_session_threads = False
        try:  # with the tensors made from a GGUF file's compact blocks (runtime/loader.py)
            self.session = self._load(path, options, chain)
        except Exception as e:  # onnxruntime raises its own untyped errors for bad files
            raise ManifestError(f"cannot load {path}: {e}; re-export the pair") from None
        self.providers = self.session.get_providers()
        self.warning = warning or fallback_warning(chain, self.providers)
        self.vocab_size = vocab_size
        # a draft scoring a subset of the vocabulary: column j of its logits is token_ids[j]
        self.token_ids = token_ids
        check_graph_io(path, spec, vocab_size, max_positions, self.session.get_inputs(),
                       self.session.get_outputs())
        self._read_graph(spec)
        self.in_place = spec.graph == "fused"
        self.min_run_tokens = spec.min_run_tokens
        # a run padded further so that it ends on a multiple of this position (1: no further):
        # where a kernel's row tiles count from the run's end, every position then sits at
        # the same place in its tile whatever run computes it (numerics.py chooses it)
        self.run_align = 1
        self.max_positions = max_positions
        self.device = "cuda" if self.providers[0] != "CPUExecutionProvider" else "cpu"
        check_probe_run(path, self)  # a graph that cannot decode fails here, not at a request
        loader.release_unpacked(self.session, self._probe)  # onnxruntime holds copies

    def _load(self, path: Path, options: ort.SessionOptions, chain: list):
        """The session; on the process's global pools where other code made them, as
        onnxruntime then requires of every session."""
        try:
            return loader.inference_session(path, options, chain)
        except Exception as e:
            if self.shared_pool or GLOBAL_POOLS_ONLY not in str(e):
                raise
        options.use_per_session_threads, self.shared_pool = False, True
        return loader.inference_session(path, options, chain)

    def _probe(self) -> list[np.ndarray]:
        """The outputs of runs of each of PROBE_RUNS tokens on an empty cache, as fed (no
        padding): which tensors a kernel reads after the load depends on the run's row count
        and on the CPU. On AVX2 without AVX-512, int8 compute's one-row kernel reads a 4-bit
        MatMulNBits' zero points at every run while runs of two rows or more read a packed
        copy, so a probe of two tokens alone let them go, and a one-token step then read
        freed memory (a draft's logits off by 15 on an AMD EPYC, emulated in the tests).
        Tokens 1, 2, ...: a table's row 0 may be zeros, and a zeroed copy of it would change
        nothing."""
        saved = self.min_run_tokens, self.run_align
        self.min_run_tokens = self.run_align = 1
        outputs = []
        try:
            for n in PROBE_RUNS:
                n = min(n, self.max_positions)
                cache = self.new_cache(n)
                features = (np.ones((n, self.feature_size), np.float32) if self.reads_features
                            else None)
                logits, rows = self.forward_rows(np.arange(1, n + 1, dtype=np.int64) %
                                                 self.vocab_size, cache, features)
                outputs += [logits.copy()] + ([rows.copy()] if rows is not None else [])
        finally:
            self.min_run_tokens, self.run_align = saved
        return outputs

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
        self.keeps_rows = LOGITS_TO_KEEP in inputs
        self._ones = np.ones((1, 0), np.int64)  # the attention mask: every position attended
        # an EAGLE-3 head reads feature rows; a target paired with one, or a head, outputs them
        self.reads_features = FEATURES in inputs
        self.row_output = next((n for n in (FEATURES, HIDDEN_OUT) if n in outputs), None)
        self.feature_size = (inputs[FEATURES].shape[2] if self.reads_features else None)
        self.output_names = ["logits", *([self.row_output] if self.row_output else []),
                             *self.kv_outputs]

    def new_cache(self, positions: int | None = None) -> KVCache | InPlaceKVCache:
        """An empty cache. An in-place one starts with room for ``positions`` (capped at
        ``max_positions``; None: a small start) and grows when a run needs more."""
        if self.in_place:
            capacity = min(self.max_positions, positions or INITIAL_POSITIONS)
            return InPlaceKVCache(self.kv_inputs, self.kv_heads, self.head_dim, capacity,
                                  self.max_positions, self.kv_dtype, self.device)
        return KVCache(self.kv_inputs, self.kv_heads, self.head_dim, self.kv_dtype)

    def forward(self, tokens: np.ndarray, cache: KVCache | InPlaceKVCache, keep: int = 0
                ) -> np.ndarray:
        """Run ``tokens [n]`` after what the cache covers; returns logits ``[n, vocab]``
        (``forward_rows``' logits; the last ``keep`` rows if given)."""
        return self.forward_rows(tokens, cache, keep=keep)[0]

    def forward_rows(self, tokens: np.ndarray, cache: KVCache | InPlaceKVCache,
                     features: np.ndarray | None = None, keep: int = 0
                     ) -> tuple[np.ndarray, np.ndarray | None]:
        """Run ``tokens [n]`` after what the cache covers; returns (logits ``[n, vocab]``, the
        graph's feature rows ``[n, h]``: FEATURES of a target paired with an EAGLE-3 head,
        HIDDEN_OUT of a head, None for other graphs). ``features [n, h]``: a head's input.
        ``keep`` > 0: the logits of the last ``keep`` rows only (fewer rows scored where the
        graph takes LOGITS_TO_KEEP; a prefill, whose logits go unread, keeps one).

        position_ids and attention_mask are derived from the cache length; the cache then
        covers the fed tokens too. A run shorter than the graph's ``min_run_tokens`` carries
        throw-away tokens after the real ones (copies of the last): causal attention keeps them
        out of the real rows, and the cache is cropped back so they leave no trace. Graphs
        computing with int8 activations need it: onnxruntime's one-row kernel rounds
        differently from the kernel every longer run uses (export/runs.py).
        """
        n = len(tokens)
        if self.reads_features != (features is not None) or (
                features is not None and len(features) != n):
            raise CacheError(f"{n} tokens fed with {'no' if features is None else len(features)}"
                             f" feature rows to a graph that reads "
                             f"{'them' if self.reads_features else 'none'}")
        keep = min(max(int(keep), 0), n)
        pad = self.padding(cache.length, n)
        if pad > 0:
            tokens = np.concatenate([tokens, np.repeat(np.asarray(tokens)[-1:], pad)])
            if features is not None:
                features = np.concatenate([features, np.repeat(features[-1:], pad, axis=0)])
            logits, rows = self._run(tokens, cache, features, keep + pad if keep else 0)
            cache.crop(cache.length - pad)
            logits, rows = logits[: len(logits) - pad], None if rows is None else rows[:n]
        else:
            logits, rows = self._run(tokens, cache, features, keep)
        return (logits[-keep:] if keep else logits), rows

    def padding(self, start: int, n: int) -> int:
        """The throw-away tokens a run of ``n`` after ``start`` cached positions carries: up
        to ``min_run_tokens`` in all, then to the next multiple of ``run_align`` positions,
        never past the window."""
        total = max(n, self.min_run_tokens)
        total += -(start + total) % self.run_align
        return max(0, min(total - n, self.max_positions - start - n))

    def _run(self, tokens: np.ndarray, cache: KVCache | InPlaceKVCache,
             features: np.ndarray | None, keep: int = 0
             ) -> tuple[np.ndarray, np.ndarray | None]:
        """One session run on ``tokens [n]`` (and ``features [n, h]``) after the cache;
        (logits ``[n, vocab]``, or of the last ``keep`` rows where the graph scores only those,
        feature rows ``[n, h]`` or None)."""
        start, n = cache.length, len(tokens)
        feeds = {"input_ids": np.asarray(tokens, dtype=np.int64)[None, :]}
        if self.keeps_rows:  # fed at every run: a binding would keep the last run's value
            feeds[LOGITS_TO_KEEP] = np.array([keep], np.int64)
        if features is not None:
            feeds[FEATURES] = np.ascontiguousarray(features, dtype=np.float32)[None]
        if self.has_attention_mask:  # a view of one buffer: no allocation that grows with the text
            if self._ones.shape[1] < start + n:
                self._ones = np.ones((1, max(start + n, 2 * self._ones.shape[1])), np.int64)
            feeds["attention_mask"] = self._ones[:, : start + n]
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(start, start + n, dtype=np.int64)[None, :]
        extra = 1 if self.row_output else 0
        if self.in_place:
            cache.reserve(n)
            outputs = self._run_in_place(feeds, cache)
            cache.advance(n)
        else:
            outputs = self.session.run(self.output_names, {**feeds, **cache.feeds()})
            cache.replace(outputs[1 + extra :], added=n)
        rows = outputs[1][0] if extra else None  # [n, h]
        return outputs[0][0, :, : self.vocab_size], rows  # [n, V]; padded rows dropped

    def _run_in_place(self, feeds: dict[str, np.ndarray], cache: InPlaceKVCache) -> list:
        """One run with each KV buffer bound as both past input and present output; the
        logits (and feature rows) as arrays."""
        if cache.binding is None:
            cache.binding = _CacheBinding(self.session, self.kv_inputs, self.kv_outputs,
                                          self.output_names[: 2 if self.row_output else 1])
        return cache.binding.run(feeds, cache.buffers)


def read_token_ids(root: Path, spec: ModelSpec, vocab_size: int) -> np.ndarray | None:
    """The ids a subset draft's columns stand for (``spec.token_ids``), checked: as many as the
    graph's columns, ascending, inside the shared vocabulary."""
    if spec.token_ids is None:
        return None
    path = Path(root) / spec.token_ids
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read {path} ({e}); re-export the pair") from None
    if (ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != spec.vocab_size
            or len(ids) == 0 or (np.diff(ids) <= 0).any() or ids[0] < 0
            or ids[-1] >= vocab_size):
        raise ManifestError(f"{path}: must hold {spec.vocab_size} ascending token ids below "
                            f"{vocab_size}; re-export the pair")
    return ids.astype(np.int64)


class _CacheBinding:
    """One IO binding kept with an in-place cache across runs.

    Each run rebinds the small inputs and the logits output (bound to a device only, so that
    onnxruntime allocates it at this run's shape: once allocated, a bound output is taken as
    preallocated); the KV buffers, bound as both past input and present output, are bound
    again only when the cache grew into new ones: a fresh binding every run costs a visible
    share of a small model's step, more the more KV buffers it binds.
    """

    def __init__(self, session: ort.InferenceSession, kv_inputs: list[str], kv_outputs: list[str],
                 outputs: list[str]):
        self.session, self.kv_names = session, list(zip(kv_inputs, kv_outputs))
        self.outputs = outputs  # the logits, then a row output if the graph has one
        self.binding = session.io_binding()
        self.buffers: list | None = None  # the OrtValues bound now

    def run(self, feeds: dict[str, np.ndarray], buffers: list) -> list[np.ndarray]:
        """``outputs`` (logits ``[1, n, vocab]``, then feature rows ``[1, n, h]``) of a run on
        ``feeds`` with ``buffers`` as the KV cache."""
        for name, array in feeds.items():
            self.binding.bind_cpu_input(name, array)
        for name in self.outputs:  # bound first: get_outputs()[:len(outputs)]
            self.binding.bind_output(name, "cpu")
        if buffers is not self.buffers:
            for (past, present), buffer in zip(self.kv_names, buffers):
                self.binding.bind_ortvalue_input(past, buffer)
                self.binding.bind_ortvalue_output(present, buffer)
            self.buffers = buffers
        self.session.run_with_iobinding(self.binding)
        values = self.binding.get_outputs()
        return [values[i].numpy() for i in range(len(self.outputs))]
