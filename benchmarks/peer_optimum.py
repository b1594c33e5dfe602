"""Peer benchmark: optimum's ORTModelForCausalLM (onnxruntime, CPU), target-only.

The target is exported with optimum (``ORTModelForCausalLM.from_pretrained(..., export=True)``,
float32, KV cache) into a cache folder once and reused; or --onnx DIR runs a graph already
exported, such as an edgespec package's target (PKG/target, with --target giving the Hugging
Face config and tokenizer), so that the two runtimes run the very same graph. Generation goes
through transformers' loop, greedy and sampled, timed as in common.py.

Only target-only runs: assisted generation (``assistant_model=``) fails with ORT models in
optimum-onnx 0.1.0 / transformers 4.57 (their past_key_values is a tuple, which the assisted
loop cannot crop). --draft is accepted, for one command line across the peers, and ignored.

    python benchmarks/peer_optimum.py --target checkpoints/demo/target \
        --prompts edgespec/models/demo/prompts.jsonl --max-new-tokens 128 --repeats 3 \
        --json build/peers/optimum.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import onnxruntime as ort
import torch
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import common
from hf_generate import generation_config, timed_generate

PACKAGES = ["optimum", "optimum-onnx", "onnxruntime", "onnx", "torch", "transformers", "numpy"]
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "build" / "peer-cache" / "optimum"


def exported(target: Path, cache: Path, rebuild: bool) -> Path:
    """The optimum export of ``target`` under ``cache``, made if missing or stale."""
    key = hashlib.sha1(str(target).encode()).hexdigest()[:10]
    out = cache / f"{target.name}-{key}"
    stamp = common.source_stamp(target)
    stamp_file = out / "peer_source.json"
    if not rebuild and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    print(f"exporting {target} with optimum into {out}", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    model = ORTModelForCausalLM.from_pretrained(target, export=True)
    model.save_pretrained(out)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return out


def staged(onnx_dir: Path, target: Path, cache: Path) -> Path:
    """A folder optimum can load: links to the graph files in onnx_dir, the target's config.

    optimum reads config.json from the model's own folder; an edgespec package's target folder
    holds only model.onnx (and model.onnx_data for large models).
    """
    key = hashlib.sha1(str(onnx_dir).encode()).hexdigest()[:10]
    out = cache / f"onnx-{onnx_dir.parent.name}-{onnx_dir.name}-{key}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for graph_file in onnx_dir.glob("model.onnx*"):
        (out / graph_file.name).symlink_to(graph_file)
    for name in ("config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, draft_length_default="")
    parser.add_argument("--onnx", help="run this exported folder (model.onnx), e.g. PKG/target, "
                                       "instead of exporting --target")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where exports are kept")
    parser.add_argument("--rebuild", action="store_true", help="export again even if cached")
    args = parser.parse_args()
    prompts = common.check_common(args)
    temperatures = common.comma_floats(args.temperature)
    torch.set_num_threads(args.threads)

    target_dir = Path(args.target).resolve()
    if args.onnx:
        onnx_dir = Path(args.onnx).resolve()
        if not (onnx_dir / "model.onnx").is_file():
            sys.exit(f"error: no model.onnx in {onnx_dir}")
        onnx_dir = staged(onnx_dir, target_dir, Path(args.cache))
    else:
        onnx_dir = exported(target_dir, Path(args.cache), args.rebuild)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    model = ORTModelForCausalLM.from_pretrained(
        onnx_dir,
        config=AutoConfig.from_pretrained(target_dir),
        generation_config=GenerationConfig.from_model_config(AutoConfig.from_pretrained(target_dir)),
        session_options=options,
        provider="CPUExecutionProvider",
        use_cache=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    common.check_context([x.shape[-1] for x in ids], args.max_new_tokens,
                         getattr(model.config, "max_position_embeddings", None))

    def baseline(i: int, temperature: float, seed: int) -> common.Timing:
        config = generation_config(tokenizer, args.max_new_tokens, temperature)
        return timed_generate(model, ids[i], config, seed)

    runs, rows = common.measure(
        args, prompts, temperatures, baseline, [],
        f"optimum-onnx {common.versions(['optimum-onnx'])['optimum-onnx']} / onnxruntime "
        f"{ort.__version__}, {args.threads} intra-op threads",
    )
    settings = {
        "n_prompts": len(prompts),
        "temperatures": temperatures,
        "onnx_dir": str(onnx_dir),
        "onnx_source": str(Path(args.onnx).resolve()) if args.onnx else "optimum export",
        "onnx_bytes": sum(p.stat().st_size for p in onnx_dir.glob("model.onnx*")),
        "providers": model.providers if hasattr(model, "providers") else None,
        "intra_op_num_threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "use_io_binding": getattr(model, "use_io_binding", None),
        "eos": "suppress_tokens=[eos]: EOS masked at every step, so every run makes max_new_tokens",
        "sampling": "temperature T > 0: do_sample, top_k=0, top_p=1 (full distribution)",
    }
    notes = ["target-only: assisted generation fails with ORT models (tuple past_key_values "
             "cannot be cropped), so --draft and --draft-length are ignored"]
    common.write_results(args.json, "optimum-onnxruntime", args, settings, PACKAGES, runs, rows,
                         notes)


if __name__ == "__main__":
    main()
