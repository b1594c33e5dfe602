"""Checks that a target and a draft checkpoint can be paired, before anything is exported.

Speculative decoding compares the two models' distributions token by token, so both must
mean the same thing by every token id they can emit and agree on the special tokens.
The checkpoints are read by source.py (Hugging Face folders by checkpoint.py, GGUF files by
gguf.py).
"""

from __future__ import annotations

from edgespec.errors import IncompatiblePairError
from edgespec.export.checkpoint import Checkpoint


def check_pair(target: Checkpoint, draft: Checkpoint) -> int:
    """Refuse a pair whose tokens or special ids differ; returns the shared vocabulary size.

    Vocabularies padded to different sizes (Qwen2 checkpoints: 151936 vs 152064 rows) are
    fine: logits are restricted to the shared range, which must mean the same in both.
    """
    shared = min(target.vocab_size, draft.vocab_size)
    sizes = len(target.tokenizer), len(draft.tokenizer)
    if sizes[0] != sizes[1]:
        raise IncompatiblePairError(
            f"the target's tokenizer has {sizes[0]} tokens and the draft's {sizes[1]}: the pair "
            "must share one tokenizer (a draft from the target's model family)"
            + ("; were --target and --draft swapped? The target is the larger model"
               if draft.weight_bytes > target.weight_bytes else "")
        )
    for ckpt, role in ((target, "target"), (draft, "draft")):
        if len(ckpt.tokenizer) > shared:
            raise IncompatiblePairError(
                f"the {role}'s tokenizer has {len(ckpt.tokenizer)} tokens but the pair shares "
                f"only {shared} rows of logits (target {target.vocab_size}, draft "
                f"{draft.vocab_size}); the draft must cover the target's whole vocabulary"
            )

    target_tokens = _id_to_token(target.tokenizer, shared)
    draft_tokens = _id_to_token(draft.tokenizer, shared)
    for i in range(shared):
        if target_tokens.get(i) != draft_tokens.get(i):
            raise IncompatiblePairError(
                f"the tokenizers differ at id {i}: target has {target_tokens.get(i)!r}, draft has "
                f"{draft_tokens.get(i)!r}; the draft must use the target's tokenizer"
            )

    specials = {
        "EOS": (target.eos_token_ids, draft.eos_token_ids),
        "BOS": (target.tokenizer.bos_token_id, draft.tokenizer.bos_token_id),
        "pad": (target.tokenizer.pad_token_id, draft.tokenizer.pad_token_id),
    }
    for name, (t, d) in specials.items():
        if t != d:
            raise IncompatiblePairError(
                f"the {name} token ids differ: target {t}, draft {d}; "
                "give both checkpoints the same special tokens"
            )
    return shared


def _id_to_token(tokenizer, limit: int) -> dict[int, str]:
    return {i: t for t, i in tokenizer.get_vocab().items() if i < limit}
