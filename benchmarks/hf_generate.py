"""Timing one ``model.generate`` call, shared by peer_transformers.py and peer_optimum.py.

Both runtimes go through transformers' generation loop (optimum's ORTModelForCausalLM is a
GenerationMixin), so one function measures both: a streamer notes when the first new tokens
arrive, and EOS is masked at every step (``suppress_tokens=[eos]``) so that every run makes
exactly ``max_new_tokens`` tokens. (``min_new_tokens`` would do the same for target-only runs,
but transformers 4.57 refuses its MinLengthLogitsProcessor in assisted generation.)
"""

from __future__ import annotations

import time

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from common import Timing

# Assisted generation warns on every call that the assistant's generate() merged its own
# defaults and that suppress_tokens built a processor twice; both are expected here.
transformers.logging.set_verbosity_error()


class FirstTokenClock(BaseStreamer):
    """Notes when generate() hands out its first new tokens (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_at: float | None = None
        self.first_tokens = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1 and self.first_at is None:
            self.first_at = time.perf_counter()
            self.first_tokens = int(value.numel())

    def end(self) -> None:
        pass


def generation_config(tokenizer, max_new_tokens: int, temperature: float) -> GenerationConfig:
    """A fresh config, so nothing in the checkpoint's generation_config.json leaks in.

    Greedy at temperature 0; otherwise plain sampling from softmax(logits / T): top_k=0 turns
    off transformers' default top-k of 50, top_p=1 keeps the whole distribution.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        suppress_tokens=[eos] if eos is not None else None,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=tokenizer.bos_token_id,
        num_beams=1,
        **sampling,
    )


def timed_generate(model, input_ids: torch.Tensor, config: GenerationConfig, seed: int,
                   **kwargs) -> Timing:
    """One generate() call: new tokens, total seconds and time to the first new token."""
    torch.manual_seed(seed)
    clock = FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config, streamer=clock, **kwargs)
    total = time.perf_counter() - start
    new = out.shape[-1] - input_ids.shape[-1]
    return Timing(
        prompt_tokens=input_ids.shape[-1],
        new_tokens=new,
        total_s=total,
        ttft_s=(clock.first_at or start + total) - start,
        extra={"first_chunk_tokens": clock.first_tokens},
    )
