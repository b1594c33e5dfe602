#!/usr/bin/env bash
# Run the peer benchmarks on the demo pair, with edgespec bench beside them when the demo
# package is there. Results go to $OUT as JSON (one file per runtime); tables go to stdout.
#
#   bash benchmarks/run_peers.sh                       # everything, demo pair, 128 tokens x 3
#   N=32 REPEATS=1 LIMIT=4 bash benchmarks/run_peers.sh  # a quick look first
#
# Settings (environment): TARGET, DRAFT, PROMPTS, PKG (edgespec package), OUT, N, REPEATS,
# DRAFT_LENGTH (GAMMA, its former name, still read), TEMPS, THREADS, LIMIT (first LIMIT
# prompts; 0: all), NGRAM (genai n-gram size; 0: off),
# PYTHON (the environment with edgespec[export]), ONLY (space-separated subset of:
# edgespec transformers optimum optimum-pkg genai genai015).
#
# onnxruntime-genai runs in two virtual environments of its own under build/, made here on
# first use, so the main environment's onnxruntime is left alone:
#   build/genai-venv    onnxruntime-genai 0.15.2 + the model builder's needs (builds graphs;
#                       its runtime has no speculative decoding)
#   build/genai18-venv  onnxruntime-genai 0.18.0 runtime (target-only, draft-model and n-gram
#                       speculative decoding on the 0.15.2-built graphs)
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=${TARGET:-checkpoints/demo/target}
DRAFT=${DRAFT:-checkpoints/demo/draft}
PROMPTS=${PROMPTS:-edgespec/models/demo/prompts.jsonl}
PKG=${PKG:-edgespec/models/demo}
OUT=${OUT:-build/peers}
N=${N:-128}
REPEATS=${REPEATS:-3}
DRAFT_LENGTH=${DRAFT_LENGTH:-${GAMMA:-1,2,4}}
TEMPS=${TEMPS:-0,1}
THREADS=${THREADS:-$(nproc)}
LIMIT=${LIMIT:-0}
NGRAM=${NGRAM:-4}
PYTHON=${PYTHON:-python}
ONLY=${ONLY:-edgespec transformers optimum optimum-pkg genai}
GENAI_BUILD=build/genai-venv
GENAI_RUN=build/genai18-venv

for path in "$TARGET" "$DRAFT" "$PROMPTS"; do
  [[ -e $path ]] || { echo "missing $path (set TARGET, DRAFT, PROMPTS)" >&2; exit 1; }
done
mkdir -p "$OUT"
wants() { [[ " $ONLY " == *" $1 "* ]]; }

common=(--target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" --max-new-tokens "$N"
        --repeats "$REPEATS" --temperature "$TEMPS" --threads "$THREADS" --limit-prompts "$LIMIT")

make_venv() {  # make_venv DIR PACKAGES...: a virtual environment with pinned packages, once
  local dir=$1; shift
  if [[ ! -x $dir/bin/python ]] || ! "$dir/bin/python" -c "import onnxruntime_genai" 2>/dev/null; then
    echo "== making $dir: $*" >&2
    "$PYTHON" -m venv "$dir"
    "$dir/bin/pip" install --quiet "$@"
  fi
}

if wants edgespec; then
  if [[ -f $PKG/edgespec.json ]]; then
    echo "== edgespec bench $PKG" >&2
    prompts_file=$PROMPTS
    if [[ $LIMIT != 0 ]]; then
      prompts_file=$OUT/prompts-first-$LIMIT.${PROMPTS##*.}
      head -n "$LIMIT" "$PROMPTS" > "$prompts_file"
    fi
    "$PYTHON" -m edgespec bench "$PKG" --prompts "$prompts_file" --draft-length "$DRAFT_LENGTH" \
      --temperature "$TEMPS" -n "$N" --repeats "$REPEATS" --provider cpu --json "$OUT/edgespec.json"
  else
    echo "== skipping edgespec bench: no package at $PKG (set PKG)" >&2
  fi
fi

if wants transformers; then
  echo "== transformers (PyTorch CPU): target-only and assisted generation" >&2
  "$PYTHON" benchmarks/peer_transformers.py "${common[@]}" --draft-length "$DRAFT_LENGTH,hf" \
    --json "$OUT/transformers.json"
fi

if wants optimum; then
  echo "== optimum ORTModelForCausalLM: target-only, its own export" >&2
  "$PYTHON" benchmarks/peer_optimum.py "${common[@]}" --json "$OUT/optimum.json"
fi

if wants optimum-pkg && [[ -f $PKG/target/model.onnx ]]; then
  echo "== optimum ORTModelForCausalLM: target-only on the edgespec package's target graph" >&2
  "$PYTHON" benchmarks/peer_optimum.py "${common[@]}" --onnx "$PKG/target" \
    --json "$OUT/optimum-edgespec-graph.json"
fi

if wants genai || wants genai015; then
  make_venv "$GENAI_BUILD" onnxruntime-genai==0.15.2 onnx-ir 'transformers==4.57.*' torch==2.13.0
fi
if wants genai; then
  make_venv "$GENAI_RUN" onnxruntime-genai==0.18.0
  echo "== onnxruntime-genai 0.18: target-only, draft-model and n-gram speculative" >&2
  "$GENAI_RUN/bin/python" benchmarks/peer_genai.py "${common[@]}" --draft-length "$DRAFT_LENGTH" \
    --builder-python "$GENAI_BUILD/bin/python" --ngram-size "$NGRAM" --json "$OUT/genai.json"
fi
if wants genai015; then
  echo "== onnxruntime-genai 0.15.2: target-only" >&2
  "$GENAI_BUILD/bin/python" benchmarks/peer_genai.py "${common[@]}" \
    --builder-python "$GENAI_BUILD/bin/python" --json "$OUT/genai-0.15.2.json"
fi

echo "== side by side (decode tokens/s; speedups against each runtime's own target-only)" >&2
"$PYTHON" benchmarks/compare.py "$OUT"/*.json
echo "results in $OUT" >&2
