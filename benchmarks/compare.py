"""One table from the JSON files of ``edgespec bench --json`` and the peer scripts.

    python benchmarks/compare.py build/peers/*.json

Decode rates: edgespec's tokens/s (new tokens / decode seconds) beside the peers'
decode_tokens_per_s (see common.py); speedups are each runtime's own (speculative against its
own target-only runs), medians of paired ratios in both. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def edgespec_rows(data: dict) -> list[dict]:
    rows, seen = [], set()
    for r in data["rows"]:
        if r["temperature"] not in seen:  # the target-only rate, once per temperature
            seen.add(r["temperature"])
            rows.append({"temperature": r["temperature"], "mode": "target", "gamma": None,
                         "decode_tokens_per_s": r["baseline_tokens_per_s"], "speedup": None,
                         "acceptance": None})
        mode = "speculative" if r.get("schedule", "fixed") == "fixed" else r["schedule"]
        # "gamma": the draft length's name in the files of edgespec bench before it was renamed
        draft_length = r["draft_length"] if "draft_length" in r else r["gamma"]
        rows.append({"temperature": r["temperature"], "mode": mode, "gamma": draft_length,
                     "decode_tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
                     "acceptance": r["acceptance_rate"]})
    return rows


def peer_rows(data: dict) -> list[dict]:
    return [{"temperature": r["temperature"], "mode": r["mode"], "gamma": r["gamma"],
             "decode_tokens_per_s": r["decode_tokens_per_s"], "speedup": r["speedup_decode"],
             "acceptance": r.get("acceptance_rate")} for r in data["rows"]]


def load(path: Path) -> tuple[str, dict, list[dict]]:
    data = json.loads(path.read_text())
    if "runtime" in data:  # a peer script
        name = data["runtime"]
        version = {"transformers": "transformers", "optimum-onnxruntime": "optimum-onnx",
                   "onnxruntime-genai": "onnxruntime-genai"}.get(name)
        label = f"{name} {data['versions'].get(version, '')}".strip()
        if data["settings"].get("onnx"):  # peer_optimum.py --onnx PKG/target
            label += " (--onnx graph)"
        info = {"new_tokens": data["settings"]["max_new_tokens"],
                "repeats": data["settings"]["repeats"], "prompts": data["settings"]["n_prompts"]}
        return label, info, peer_rows(data)
    config = data["config"]  # edgespec bench
    info = {"new_tokens": config["max_new_tokens"], "repeats": config["repeats"],
            "prompts": data["prompts"]}
    return "edgespec", info, edgespec_rows(data)


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        sys.exit(__doc__)
    print(f"{'runtime':<40} {'temp':>4} {'mode':<11} {'gamma':>5} {'decode tok/s':>12} "
          f"{'speedup':>7} {'accept':>6}  (new tokens, repeats, prompts)")
    for path in paths:
        label, info, rows = load(path)
        for r in rows:
            gamma = "" if r["gamma"] is None else str(r["gamma"])
            speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            accept = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            print(f"{label:<40} {r['temperature']:>4g} {r['mode']:<11} {gamma:>5} "
                  f"{r['decode_tokens_per_s']:>12.1f} {speedup:>7} {accept:>6}  "
                  f"({info['new_tokens']}, {info['repeats']}, {info['prompts']})")


if __name__ == "__main__":
    main()
