"""Peer benchmark: Hugging Face transformers on PyTorch (CPU), target-only against assisted.

Target-only is ``model.generate(...)``; assisted generation is
``model.generate(..., assistant_model=draft)``, transformers' speculative decoding (greedy
verification at temperature 0, Leviathan et al.'s speculative sampling when sampling). Each
--draft-length value fixes the draft length (num_assistant_tokens, schedule "constant", no early
stop on draft confidence); "hf" leaves the assistant's own defaults (transformers 4.57: up to
20 tokens, stopping when the draft's confidence drops below 0.4).

Both models run in float32 (float16 checkpoints are upcast, as edgespec's export does) on
torch.set_num_threads(--threads), every core by default. Timing as in common.py.

    python benchmarks/peer_transformers.py --target checkpoints/demo/target \
        --draft checkpoints/demo/draft --prompts edgespec/models/demo/prompts.jsonl \
        --max-new-tokens 128 --repeats 3 --json build/peers/transformers.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from hf_generate import generation_config, timed_generate

PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "numpy"]


def parse_gammas(text: str) -> list[int | str]:
    gammas: list[int | str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "hf":
            gammas.append(item)
        elif item.isdigit() and int(item) >= 1:
            gammas.append(int(item))
        else:
            sys.exit(f"error: --draft-length takes integers >= 1 and 'hf', got {item!r}")
    return gammas


def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


class CallCounter:
    """Counts forward passes of a model (a forward hook on its top module)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.calls += 1


def counted(timing: common.Timing, target: CallCounter, draft: CallCounter | None,
            before: tuple[int, int]) -> common.Timing:
    """Add forward-pass counts to a run's extra fields.

    In assisted generation every target pass is one round (the first also reads the prompt)
    and commits the accepted drafts plus one target token, and every draft pass proposes one
    token; so accepted = new tokens - target passes, proposed = draft passes.
    """
    target_calls = target.calls - before[0]
    timing.extra["target_calls"] = target_calls
    timing.extra["tokens_per_target_call"] = timing.new_tokens / target_calls
    if draft is not None:
        timing.extra["draft_tokens_proposed"] = draft.calls - before[1]
        timing.extra["draft_tokens_accepted"] = timing.new_tokens - target_calls
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, draft_length_default="1,2,4")
    args = parser.parse_args()
    prompts = common.check_common(args)
    temperatures = common.comma_floats(args.temperature)
    gammas = parse_gammas(args.draft_length) if args.draft else []
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = load(args.target)
    draft = load(args.draft) if args.draft else None
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    common.check_context([x.shape[-1] for x in ids], args.max_new_tokens,
                         getattr(target.config, "max_position_embeddings", None))
    target_counter = CallCounter(target)
    draft_counter = CallCounter(draft) if draft is not None else None
    assistant_keys = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                      "assistant_confidence_threshold")
    defaults = {k: getattr(draft.generation_config, k) for k in assistant_keys} if draft else {}

    def calls() -> tuple[int, int]:
        return target_counter.calls, draft_counter.calls if draft_counter else 0

    def configure_draft(gamma: int | str) -> None:
        g = draft.generation_config
        if gamma == "hf":
            for key, value in defaults.items():
                setattr(g, key, value)
        else:
            g.num_assistant_tokens = gamma
            g.num_assistant_tokens_schedule = "constant"
            g.assistant_confidence_threshold = 0.0

    def baseline(i: int, temperature: float, seed: int) -> common.Timing:
        config = generation_config(tokenizer, args.max_new_tokens, temperature)
        before = calls()
        return counted(timed_generate(target, ids[i], config, seed), target_counter, None, before)

    def assisted(gamma: int | str) -> common.Generate:
        def generate(i: int, temperature: float, seed: int) -> common.Timing:
            configure_draft(gamma)
            config = generation_config(tokenizer, args.max_new_tokens, temperature)
            before = calls()
            timing = timed_generate(target, ids[i], config, seed, assistant_model=draft)
            return counted(timing, target_counter, draft_counter, before)
        return generate

    variants = [("assisted", g, assisted(g)) for g in gammas]
    runs, rows = common.measure(
        args, prompts, temperatures, baseline, variants,
        f"transformers {common.versions(['transformers'])['transformers']} / torch "
        f"{torch.__version__}, {args.threads} threads",
    )
    settings = {
        "n_prompts": len(prompts),
        "temperatures": temperatures,
        "gammas": gammas,
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "eos": "suppress_tokens=[eos]: EOS masked at every step, so every run makes max_new_tokens",
        "sampling": "temperature T > 0: do_sample, top_k=0, top_p=1 (full distribution)",
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()) if draft else None,
    }
    notes = [f"assisted gamma 'hf' = the draft's own assistant settings {defaults}"
             if draft is not None else "no draft: target-only runs"]
    common.write_results(args.json, "transformers", args, settings, PACKAGES, runs, rows, notes)


if __name__ == "__main__":
    main()
