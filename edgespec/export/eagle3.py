"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): the checkpoint format, its checks, and a PyTorch
reference of the head that the ONNX head graph (export/eagle3_graph.py) is validated against.

A head is one decoder layer fed the target's own hidden states. Format of the published
checkpoints (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; read as vLLM's
``vllm/model_executor/models/llama_eagle3.py`` loads them, the code here written anew):

- config.json: ``architectures`` LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM, Llama's
  hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps, rope
  settings; ``vocab_size`` (the target's) and ``draft_vocab_size`` (rows of its lm_head);
  optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``.
- weights: ``fc.weight`` [h, 3h]; ``midlayer.{hidden_norm, input_layernorm,
  post_attention_layernorm}.weight`` [h]; ``midlayer.self_attn.{q,k,v}_proj.weight`` with input
  2h; ``o_proj``; ``midlayer.mlp.{gate,up,down}_proj``; ``norm.weight``; ``lm_head.weight``
  [draft_vocab, h]; ``d2t`` [draft_vocab] (target id = draft id + d2t[draft id]); ``t2d``
  [vocab] bool (optional here: it is d2t's image). No embedding: the target's table is used.

The maths of one row (position j, token x, feature g [h]):

    g = fc(cat(a_0, a_1, a_2))          a_i: the target's residual stream entering layer
                                        aux[i] (Hugging Face's hidden_states[aux[i]])
    z = cat(RMSNorm_in(emb(x)), RMSNorm_hidden(g))           [2h]
    r = g + o_proj(attention(q, k, v of z, rotary at j))    residual: the un-normed g (the
                                        normed one, RMSNorm_hidden(g), for a head whose config
                                        says norm_before_residual, as SpecForge trains some)
    r = r + mlp(RMSNorm_post(r))
    logits = lm_head(RMSNorm_final(r))  [draft_vocab];  hidden_out = r  [h]

The aux layers are the config's, else aux_layers.default_aux_layers (the one rule for them).

Training-time test: drafting position n+1 after n runs the head on (emb(draft_n), the head's
own hidden_out of the row before) instead of a target feature; the drafter (runtime) does that.
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgespec.errors import ExportError, one_line, shown
from edgespec.export.aux_layers import aux_layers_problem, default_aux_layers
from edgespec.export.tensors import (MAX_JSON, CheckpointTensors, folder_file, read_json,
                                     safetensors_files)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
D2T, T2D = "d2t", "t2d"
_BIN = "pytorch_model.bin"


def is_eagle3_head(folder: Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 head (its config names one of ARCHITECTURES)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    try:
        with open(config, "rb") as f:  # bounded: a config.json larger than that is no head's
            raw = json.loads(f.read(MAX_JSON + 1))
    except (OSError, ValueError, RecursionError):
        return False
    names = raw.get("architectures") if isinstance(raw, dict) else None
    if isinstance(names, str):  # one name, not the list it belongs in: read_head_config says so
        names = [names]
    return isinstance(names, list) and any(a in ARCHITECTURES for a in names
                                           if isinstance(a, str))


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 head's shapes, checked against its target."""

    path: Path
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab: int  # the target's vocabulary
    draft_vocab: int  # rows of the head's lm_head
    aux_layers: tuple[int, int, int]  # target layers whose input residual streams feed fc
    rope: dict  # rope_theta, rope_scaling, max_position_embeddings (the head's rotary)
    norm_before_residual: bool = False  # the residual is RMSNorm_hidden(g), not g

    def llama_config(self):
        """A transformers LlamaConfig of the head's layer (for its rotary embedding)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate, rms_norm_eps=self.eps,
                           vocab_size=self.vocab, num_hidden_layers=1, **self.rope)


def read_head_config(folder: Path, target_config) -> HeadConfig:
    """The head's config, every field checked (type and range), then against the target's (a
    transformers config).

    Collects every problem and raises one ExportError listing them (optimum's way)."""
    folder = Path(folder)
    raw = read_json(folder, "config.json")
    if not isinstance(raw, dict):
        raise ExportError(f"{folder / 'config.json'} is not a JSON object; is it an EAGLE-3 "
                          "head folder?")
    fields = _HeadFields(raw)
    names = raw.get("architectures")
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        fields.problems.append(f"architectures {shown(names)} is not a list of class names "
                               f"(such as [{ARCHITECTURES[0]!r}])")
    hidden = fields.integer("hidden_size", None, 1 << 17)
    heads = fields.integer("num_attention_heads", None, 1024)
    kv_heads = fields.integer("num_key_value_heads", heads or 1, heads or 1024)
    head_dim = fields.integer("head_dim", max(1, hidden // heads) if hidden and heads else 1,
                              1024)
    intermediate = fields.integer("intermediate_size", None, 1 << 20)
    vocab = fields.integer("vocab_size", target_config.vocab_size, 1 << 22)
    draft_vocab = fields.integer("draft_vocab_size", vocab or target_config.vocab_size,
                                 vocab or 1 << 22)
    eps = fields.number("rms_norm_eps", 1e-6)
    rope = {"rope_theta": fields.number("rope_theta", None),
            "rope_scaling": _rope_scaling(raw.get("rope_scaling"), fields.problems)}
    norm_before_residual = raw.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        fields.problems.append(f"norm_before_residual {shown(norm_before_residual)} is not "
                               "true or false")
    if heads and kv_heads and heads % kv_heads:
        fields.problems.append(f"num_key_value_heads {kv_heads} does not divide "
                               f"num_attention_heads {heads}")
    problems = fields.problems
    if hidden is not None and hidden != target_config.hidden_size:
        problems.append(f"hidden_size {hidden} is not the target's {target_config.hidden_size} "
                        "(the head reads the target's embedding and hidden states)")
    if vocab is not None and vocab != target_config.vocab_size:
        problems.append(f"vocab_size {vocab} is not the target's {target_config.vocab_size}")
    layers = target_config.num_hidden_layers
    aux = _aux_layers(raw, layers, problems)
    if raw.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {shown(raw['num_hidden_layers'])}; edgespec "
                        "runs one-layer EAGLE-3 heads")
    if problems:
        raise ExportError(f"{folder} is not an EAGLE-3 head for this target: "
                          + "; ".join(problems))
    # the head runs at the target's positions: its rotary table covers the target's window
    rope = {k: v for k, v in rope.items() if v is not None}
    rope["max_position_embeddings"] = target_config.max_position_embeddings
    return HeadConfig(
        path=folder, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, eps=eps, vocab=vocab, draft_vocab=draft_vocab,
        aux_layers=aux, rope=rope, norm_before_residual=norm_before_residual)


class _HeadFields:
    """A head config's values read with their type and range checked; each problem is noted in
    ``problems`` (named by its key) and its value read as None."""

    def __init__(self, raw: dict):
        self.raw, self.problems = raw, []

    def integer(self, key: str, default: int | None, high: int) -> int | None:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                self.problems.append(f"config.json has no {key}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            self.problems.append(f"{key} {shown(value)} is not an integer in 1..{high:,}")
            return None
        return value

    def number(self, key: str, default: float | None) -> float | None:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            self.problems.append(f"{key} {shown(value)} is not a positive number")
            return default
        return float(value)


def _rope_scaling(scaling: object, problems: list[str]) -> dict | None:
    """config.json's rope_scaling, if the head's rotary can be made from it: an object whose
    rope_type (or type) is one transformers computes with no dependence on the sequence length,
    its other fields numbers (finite; a factor >= 1), lists of numbers or true/false, and
    transformers' Llama rotary built from it (whose own validation only logs); else None, with
    the problem noted."""
    if scaling is None:
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def number(v: object) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)

    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    kinds = sorted(k for k in ROPE_INIT_FUNCTIONS if k not in ("dynamic", "longrope"))
    if not isinstance(kind, str) or kind not in (*kinds, "default"):
        problems.append(f"rope_scaling {shown(scaling)} is not an object whose rope_type is "
                        f"one of {', '.join(kinds)}")
        return None
    wrong = [k for k, v in scaling.items() if k not in ("rope_type", "type") and not (
        number(v) or isinstance(v, bool) or isinstance(v, list) and all(map(number, v)))]
    factor = scaling.get("factor", 1.0)
    if wrong or not number(factor) or factor < 1:
        problems.append(f"rope_scaling {shown(scaling)}: "
                        + (f"{', '.join(map(shown, wrong))} not numbers" if wrong
                           else "factor is not a number >= 1"))
        return None
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:  # what the head's graph and its reference compute from it (KeyError for a field missing)
        LlamaRotaryEmbedding(config=LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                num_hidden_layers=1, rope_scaling=scaling))
    except Exception as e:  # noqa: BLE001: any of transformers' refusals, said in one line
        problems.append(f"rope_scaling {shown(scaling)}: {shown(one_line(e, 120), 140)}")
        return None
    return scaling


def _aux_layers(raw: dict, layers: int, problems: list[str]) -> tuple[int, ...]:
    """eagle_config.eagle_aux_hidden_state_layer_ids (or the key at the top level, or the
    default): three layer ids of the target (aux_layers.py: the default never repeats one; a
    config may)."""
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        problems.append(f"eagle_config {shown(eagle)} is not an object")
        eagle = {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get(
        "eagle_aux_hidden_state_layer_ids")
    try:
        aux = aux or default_aux_layers(layers)
    except ExportError as e:
        problems.append(str(e))
        return ()
    problem = aux_layers_problem(aux, layers, repeats=True)
    if problem:
        problems.append(problem)
        return ()
    return tuple(aux)


class HeadTensors:
    """The head's weights by name: its safetensors files, or a pytorch_model.bin (the format
    the EAGLE repository publishes), checked against the config's shapes on opening."""

    def __init__(self, config: HeadConfig):
        self.path = config.path
        if safetensors_files(config.path):
            self._source = CheckpointTensors(config.path)
        elif (config.path / _BIN).is_file():
            self._source = _StateTensors(_read_bin(config.path))
        else:
            raise ExportError(f"{config.path} has no model.safetensors or {_BIN}; "
                              "download the head's weights")
        self._check(config)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._source.shape(name))

    def read(self, name: str) -> torch.Tensor:
        return self._source.read(name)

    @property
    def nbytes(self) -> int:
        return self._source.nbytes

    def target_ids(self, config: HeadConfig) -> np.ndarray:
        """The target id of each draft id (draft id + d2t[draft id]) ``[draft_vocab]``."""
        d2t = self.read(D2T).long().numpy()
        return np.arange(len(d2t), dtype=np.int64) + d2t

    def _check(self, config: HeadConfig) -> None:
        h, a, kv = config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim
        i, dv = config.intermediate, config.draft_vocab
        expected = {
            "fc.weight": (h, 3 * h),
            "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (a, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, a),
            "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i),
            "lm_head.weight": (dv, h), D2T: (dv,),
        }
        problems = [f"{name} is missing" if name not in self else
                    f"{name} is {list(self.shape(name))}, not {list(shape)}"
                    for name, shape in expected.items()
                    if name not in self or self.shape(name) != shape]
        if not problems:
            ids = self.target_ids(config)
            if ids.min() < 0 or ids.max() >= config.vocab:
                problems.append(f"d2t maps draft ids outside the target's vocabulary "
                                f"0..{config.vocab - 1}")
            elif len(np.unique(ids)) != len(ids):
                problems.append("d2t maps two draft ids to one target id")
        if problems:
            raise ExportError(f"{config.path}: malformed EAGLE-3 head: " + "; ".join(problems)
                              + "; re-download or re-convert the head")


def _read_bin(folder: Path) -> dict[str, torch.Tensor]:
    """The head's pytorch_model.bin as plain tensors: torch's weights-only unpickler, which
    refuses a pickle that would run code (anything but tensors and containers)."""
    file = folder_file(folder, _BIN, "its weights")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError,
            OSError) as e:
        reason = shown(one_line(e, None), 160)
        raise ExportError(f"{file} is not a file of plain weights ({reason}); edgespec loads "
                          "no pickled code: convert the head to safetensors from a source you "
                          "trust") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ExportError(f"{file} is not a state dict of tensors by name; download the head "
                          "again")
    return state


class _StateTensors:
    """A loaded state dict with the tensor sources' interface."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def read(self, name: str) -> torch.Tensor:
        return self._state[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state.values())


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Eagle3Head(nn.Module):
    """The PyTorch reference of an EAGLE-3 head, float32, written from the maths above.

    ``embedding``: the target's input embedding table ``[vocab, h]`` (the head has none).
    """

    def __init__(self, config: HeadConfig, embedding: torch.Tensor):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        h, i = config.hidden, config.intermediate
        self.config = config
        self.embedding = embedding.float()
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.hidden_norm, self.input_norm = _RMSNorm(h, config.eps), _RMSNorm(h, config.eps)
        self.post_norm, self.norm = _RMSNorm(h, config.eps), _RMSNorm(h, config.eps)
        d = config.head_dim
        self.q = nn.Linear(2 * h, config.heads * d, bias=False)
        self.k = nn.Linear(2 * h, config.kv_heads * d, bias=False)
        self.v = nn.Linear(2 * h, config.kv_heads * d, bias=False)
        self.o = nn.Linear(config.heads * d, h, bias=False)
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        self.rotary = LlamaRotaryEmbedding(config=config.llama_config())

    _NAMES = {"fc": "fc", "hidden_norm": "midlayer.hidden_norm",
              "input_norm": "midlayer.input_layernorm",
              "post_norm": "midlayer.post_attention_layernorm", "norm": "norm",
              "q": "midlayer.self_attn.q_proj", "k": "midlayer.self_attn.k_proj",
              "v": "midlayer.self_attn.v_proj", "o": "midlayer.self_attn.o_proj",
              "gate": "midlayer.mlp.gate_proj", "up": "midlayer.mlp.up_proj",
              "down": "midlayer.mlp.down_proj", "lm_head": "lm_head"}

    @classmethod
    def weight_names(cls) -> list[str]:
        """The checkpoint names of the head's matrices and norms (d2t and t2d aside)."""
        return [f"{name}.weight" for name in cls._NAMES.values()]

    @classmethod
    def load(cls, config: HeadConfig, tensors: HeadTensors, embedding: torch.Tensor
             ) -> "Eagle3Head":
        head = cls(config, embedding)
        with torch.no_grad():
            for module, name in cls._NAMES.items():
                getattr(head, module).weight.copy_(tensors.read(f"{name}.weight").float())
        return head.eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One run of s rows after ``cache`` (keys and values of earlier rows at positions
        0..past-1, ``[1, kv_heads, past, head_dim]`` each, or None).

        input_ids ``[1, s]``; features ``[1, s, 3h]`` (the three aux streams) or ``[1, s, h]``
        (fc applied already, or the head's own hidden_out); positions ``[1, s]``, past..past+s-1.
        Returns (logits ``[1, s, draft_vocab]``, hidden_out ``[1, s, h]``, the new cache).
        """
        cfg = self.config
        g = self.fc(features) if features.shape[-1] == 3 * cfg.hidden else features
        hidden = self.hidden_norm(g)
        z = torch.cat([self.input_norm(self.embedding[input_ids]), hidden], -1)
        s, d = input_ids.shape[1], cfg.head_dim
        q = self.q(z).view(1, s, cfg.heads, d).transpose(1, 2)  # [1, heads, s, d]
        k = self.k(z).view(1, s, cfg.kv_heads, d).transpose(1, 2)
        v = self.v(z).view(1, s, cfg.kv_heads, d).transpose(1, 2)
        cos, sin = self.rotary(z, positions)  # [1, s, d], rotate-half layout
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        groups = cfg.heads // cfg.kv_heads
        keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = q @ keys.transpose(2, 3) / math.sqrt(d)  # [1, heads, s, past + s]
        past = k.shape[2] - s
        allowed = torch.arange(past + s)[None, :] <= (past + torch.arange(s))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        context = (scores.softmax(-1) @ values).transpose(1, 2).reshape(1, s, cfg.heads * d)
        r = (hidden if cfg.norm_before_residual else g) + self.o(context)
        x = self.post_norm(r)
        r = r + self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return self.lm_head(self.norm(r)), r, (k, v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout (Llama's): x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def aux_features(target_model, ids: torch.Tensor, config: HeadConfig) -> torch.Tensor:
    """The target's three aux streams for ``ids`` ``[1, s]``: ``[1, s, 3h]`` (a loaded
    transformers model; hidden_states[i] is the residual stream entering layer i)."""
    with torch.no_grad():
        states = target_model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i].float() for i in config.aux_layers], -1)


def write_random_head(folder: Path, target_config, draft_vocab: int | None = None,
                      seed: int = 0, aux_layers: tuple[int, int, int] | None = None,
                      init: float = 0.02, intermediate: int | None = None) -> Path:
    """A random-weights EAGLE-3 head for ``target_config`` in the published format (tests,
    cost benchmarks). ``draft_vocab``: its lm_head scores the first that many target ids,
    spread over the vocabulary (every other id) when it has room; None: the whole vocabulary.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True)
    h, vocab = target_config.hidden_size, target_config.vocab_size
    heads = target_config.num_attention_heads
    kv = getattr(target_config, "num_key_value_heads", None) or heads
    d = getattr(target_config, "head_dim", None) or h // heads
    i = intermediate or target_config.intermediate_size
    dv = draft_vocab or vocab
    step = 2 if 2 * dv <= vocab else 1
    d2t = torch.arange(dv) * step - torch.arange(dv)  # target id = draft id + d2t = step * id
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(dv) * step] = True
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * init

    def ones_ish(size):
        return 1 + normal(size)

    weights = {
        "fc.weight": normal(h, 3 * h),
        "midlayer.hidden_norm.weight": ones_ish(h), "midlayer.input_layernorm.weight": ones_ish(h),
        "midlayer.post_attention_layernorm.weight": ones_ish(h), "norm.weight": ones_ish(h),
        "midlayer.self_attn.q_proj.weight": normal(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": normal(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": normal(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": normal(h, heads * d),
        "midlayer.mlp.gate_proj.weight": normal(i, h), "midlayer.mlp.up_proj.weight": normal(i, h),
        "midlayer.mlp.down_proj.weight": normal(h, i),
        "lm_head.weight": normal(dv, h), D2T: d2t, T2D: t2d,
    }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_size": h,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "intermediate_size": i, "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
        "rope_theta": getattr(target_config, "rope_theta", 10000.0),
        "max_position_embeddings": target_config.max_position_embeddings,
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": dv,
        "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
