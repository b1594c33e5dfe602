#!/usr/bin/env bash
# The whole GPU path in one run, for a machine with an NVIDIA GPU (a few minutes):
# export the demo checkpoints for CPU and for GPU (fp16), the GPU tests, CUDA and TensorRT
# generation, and a short bench on each provider. Results go to $OUT (default build/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -m venv build/gpu-venv && source build/gpu-venv/bin/activate
pip install -q "torch==2.13.0" && pip install -q -e ".[export,test]"
pip uninstall -y -q onnxruntime && pip install -q -e ".[gpu]"
python -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"

edgespec export --target checkpoints/demo/target --draft checkpoints/demo/draft \
    --out "$OUT/demo-fp16" --dtype fp16
python -m pytest -q tests/test_gpu.py
for provider in cuda tensorrt; do
    edgespec generate edgespec/models/demo "def fibonacci(n):" -n 64 --provider "$provider" --json \
        > "$OUT/generate-$provider.json"
done
edgespec generate "$OUT/demo-fp16" "def fibonacci(n):" -n 64 --provider cuda --json \
    > "$OUT/generate-cuda-fp16.json"
edgespec bench edgespec/models/demo --provider cuda --draft-length 1,2,4,8 --temperature 0,1 \
    -n 128 --repeats 2 --json "$OUT/bench-cuda.json"
edgespec bench "$OUT/demo-fp16" --prompts edgespec/models/demo/prompts.jsonl --provider cuda --draft-length 1,2,4,8 --temperature 0,1 \
    -n 128 --repeats 2 --json "$OUT/bench-cuda-fp16.json"
