"""All of edgespec's training, in PyTorch: the pieces every recipe shares, the recipes of the
SmolLM2 draft and of EAGLE-3 heads, and the recipe that rebuilds the bundled demo pair, a small
Python code model and its draft. Nothing at run time imports it; config.py and
chat_prompts.py, the settings and the prompts, import no torch (the command line's defaults
are read from config.py), and neither does this package's own import.

The demo pair's recipe: both models are trained from scratch on this machine's CPU, on the
standard library sources of the running interpreter, so the recipe needs no download:

1. find the corpus (stdlib ``.py`` files, no tests) and split it by file into train / held-out
   (corpus.py);
2. train a byte-level BPE tokenizer on the train split (tokenizer.py);
3. train the target (``LlamaForCausalLM``, model.py) on next-token loss for ``target_minutes``
   (train.py);
4. distil the draft from the target, minimising KL(p || q) on its logits, for ``draft_minutes``
   (train.py);
5. measure both on the held-out split (evaluate.py), with the draft's expected acceptance rate
   sum_x min(p(x), q(x)) (Leviathan et al., 2023, "Fast Inference from Transformers via
   Speculative Decoding", section 3);
6. save both as float16 Hugging Face checkpoints next to a training report, and export the pair
   into an edgespec package (build.py).

config.py holds RecipeConfig, every setting the steps read. The training shared by every model
family: the teacher data (teacher.py), the losses (losses.py), the one training loop (loop.py)
and the one acceptance estimate (evaluate.py), which the SmolLM2 draft (smollm2_draft.py) and
EAGLE-3 heads (eagle3_head.py, edgespec distill) use too.
As everywhere in edgespec, p is the target's distribution and q the draft's.
Each training phase stops on a wall-clock budget: two runs with the same seed draw the same
batches in the same order, but not necessarily the same number of them.
"""

from edgespec.models.training.config import ModelShape, RecipeConfig  # light: the CLI's defaults


def __getattr__(name: str):
    if name == "build_demo_package":  # imports torch: only when the recipe runs
        from edgespec.models.training.build import build_demo_package

        return build_demo_package
    raise AttributeError(f"module 'edgespec.models.training' has no attribute {name!r}")


__all__ = ["ModelShape", "RecipeConfig", "build_demo_package"]
