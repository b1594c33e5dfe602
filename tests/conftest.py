"""Tiny random checkpoints with a locally trained tokenizer, exported through the real exporter.

Built once per test session (a few seconds); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

from edgespec.errors import EdgespecError
from edgespec.models import registry
from edgespec.runtime import machine

SLOW_TIMEOUT_S = 900  # a test marked slow (a venv and pip, a full re-export) may take this long


def pytest_collection_modifyitems(items) -> None:
    """Tests marked slow get SLOW_TIMEOUT_S instead of pyproject's per-test timeout, unless
    they name their own."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


# Step costs the adaptive schedule measures are cached per user (runtime/calibration.py): tests
# (and the CLI processes they start) use a fresh folder, never the user's, and always measure.
# The real models built there (models/registry.py) stay where they are: tests read them.
with contextlib.suppress(EdgespecError):  # no folder to name: no real model either
    os.environ.setdefault("EDGESPEC_MODELS_DIR", str(registry.models_folder()))
os.environ["EDGESPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="edgespec-test-cache-")
# Whether measured costs are stored must not hang on what else the machine runs beside the
# suite: in this process, no neighbour makes it busy (test_calibration.py tests the rule itself)
machine.BUSY_SHARE = 1.0

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln: naïve café, déjà vu, 東京 and 北京, emoji 🙂 too.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
] * 20


def _train_bpe(vocab_size: int, corpus: list[str] = CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _train_words(words: list[str]):
    """A word-level tokenizer with a handful of tokens, for distribution tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def _hf_tokenizer(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _save(model, tokenizer, folder: Path) -> Path:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def llama(vocab: int, hidden: int, layers: int, seed: int, init: float = 0.02, positions=128):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=positions, initializer_range=init,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def qwen3(vocab: int, hidden: int, layers: int, seed: int, **config):
    """A random Qwen3 with 4 heads over 2 KV heads of ``head_dim`` 32 (not hidden / heads, as
    in the real ones), tied, and its q/k norm weights drawn around 1: with equal weights on
    the two dimensions a rotation pairs (all 1, the initial value), normalizing before or after
    the rotation gives the same numbers, and a test could not tell the order."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True) | config)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.3)
    return model


def gemma3(vocab: int, hidden: int, seed: int, window: int = 8, **config):
    """A random Gemma 3 with Gemma 3's layer pattern at a small size: local (sliding-window)
    layers around a global one (``layer_types``), 4 heads over 2 KV heads of head_dim 32,
    q.k scaled by a ``query_pre_attn_scalar`` other than head_dim, rope bases 1e6 (global)
    and 1e4 (local), a window of ``window`` positions, tied. Its norm weights are drawn away from
    0 (Gemma scales by 1 + w: a graph that forgot the 1, or added it twice, is far off)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True) | config)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.3)
            elif "embed" in name:
                parameter.normal_(0, 0.05)  # rows scaled by sqrt(hidden) = 8
    return model


def gpt2(vocab: int, hidden: int, layers: int, seed: int, init: float = 0.02, positions=128):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=positions,
        initializer_range=init, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def greedy_is_target_only(pipe, prompts, draft_length: int, drafter: str | None = None
                          ) -> tuple[int, int]:
    """Greedy output with drafting at a fixed ``draft_length`` (``drafter`` if given, else the
    package's) equals target-only output on every prompt (24 tokens each); returns the tokens
    (drafted, accepted) over all of them, for the caller to assert on."""
    drafted = accepted = 0
    for prompt in prompts:
        baseline = pipe.generate(prompt, max_new_tokens=24, drafter="none").token_ids
        result = pipe.generate(prompt, max_new_tokens=24, draft_length=draft_length,
                               schedule="fixed", **({"drafter": drafter} if drafter else {}))
        assert result.token_ids == baseline
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    return drafted, accepted


def noisy_copy(model, scale: float, seed: int):
    """The same model with every weight perturbed: a draft that agrees with it part of the time."""
    import copy

    import torch

    torch.manual_seed(seed)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return noisy


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Hugging Face folders: Llama and GPT-2 targets and drafts, and some that must not pair."""
    root = tmp_path_factory.mktemp("checkpoints")
    bpe = _hf_tokenizer(_train_bpe(400))
    vocab = len(bpe)
    # same size, other merges: must be refused
    other = _hf_tokenizer(_train_bpe(400, [line[::-1] for line in CORPUS]))
    words = _hf_tokenizer(_train_words(["a", "b", "c", "d", "e", "f", "g"]))
    llama_target = llama(vocab, 64, 2, seed=1)
    return {
        "llama_target": _save(llama_target, bpe, root / "llama_target"),
        "llama_noisy": _save(noisy_copy(llama_target, 0.15, seed=8), bpe, root / "llama_noisy"),
        # padded to more rows than the target, as Qwen2 checkpoints are: must still pair
        "llama_draft": _save(llama(vocab + 24, 32, 1, seed=2), bpe, root / "llama_draft"),
        "gpt2_target": _save(gpt2(vocab, 64, 2, seed=3), bpe, root / "gpt2_target"),
        "gpt2_draft": _save(gpt2(vocab, 32, 1, seed=4), bpe, root / "gpt2_draft"),
        "other_tokenizer": _save(llama(vocab, 32, 1, seed=5), other, root / "other_tok"),
        # tiny vocabulary, peaked random distributions: target and draft differ a lot
        "words_target": _save(llama(len(words), 32, 2, seed=6, init=0.3), words, root / "wt"),
        "words_draft": _save(llama(len(words), 16, 1, seed=7, init=0.3), words, root / "wd"),
        # the same, with heads of 16 (edgespec's fused graph, which a subset draft needs)
        "words_target_fused": _save(llama(len(words), 64, 2, seed=6, init=0.2), words,
                                    root / "wtf"),
        "words_draft_fused": _save(llama(len(words), 64, 1, seed=7, init=0.2), words,
                                   root / "wdf"),
    }


@pytest.fixture(scope="session")
def packages(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Exported edgespec packages, made by the real exporter."""
    from edgespec.export import export_pair

    root = tmp_path_factory.mktemp("packages")
    pairs = {  # Llama pairs get edgespec's fused graph by default, GPT-2 optimum's
        "llama": ("llama_target", "llama_draft", "auto"),
        "gpt2": ("gpt2_target", "gpt2_draft", "auto"),
        "llama_self": ("llama_target", "llama_target", "auto"),
        "llama_noisy": ("llama_target", "llama_noisy", "auto"),
        "llama_noisy_optimum": ("llama_target", "llama_noisy", "optimum"),
        "words": ("words_target", "words_draft", "auto"),
    }
    for name, (target, draft, graph) in pairs.items():
        export_pair(checkpoints[target], checkpoints[draft], root / name, graph=graph)
    return {name: root / name for name in pairs}


@pytest.fixture(scope="session")
def chat_package(checkpoints, tmp_path_factory) -> Path:
    """The Llama pair exported from a target whose tokenizer has a chat template."""
    from edgespec.export import export_pair
    from serve_helpers import with_chat_template

    root = tmp_path_factory.mktemp("chat")
    target = with_chat_template(checkpoints["llama_target"], root / "target")
    export_pair(target, checkpoints["llama_draft"], root / "chat", validation="skip")
    return root / "chat"


# ChatML's shape (SmolLM2's, Qwen's) with a BOS first, as Llama-family templates write one
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chatml_package(tmp_path_factory) -> Path:
    """A Llama pair whose tokenizer adds BOS to text (as Llama's does: the manifest's
    add_bos_token) and has a ChatML-like template that writes BOS itself; <|im_end|> is its
    EOS. A window of 1024 tokens, which edgespec bench's task prompts fit."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from edgespec.export import export_pair

    root = tmp_path_factory.mktemp("chatml")
    backend = _train_bpe(400)
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
        special_tokens=[("<|endoftext|>", backend.token_to_id("<|endoftext|>"))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
    target = llama(len(tokenizer), 64, 2, seed=1, positions=1024)
    draft = noisy_copy(target, 0.15, seed=8)
    for model in (target, draft):
        model.config.eos_token_id = tokenizer.eos_token_id
    export_pair(_save(target, tokenizer, root / "target"), _save(draft, tokenizer, root / "draft"),
                root / "package", validation="skip")
    return root / "package"
