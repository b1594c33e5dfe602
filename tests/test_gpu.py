"""The GPU path: runs only where onnxruntime-gpu finds a CUDA device; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import edgespec

pytestmark = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs onnxruntime-gpu and a CUDA device",
)


@pytest.fixture(scope="module")
def cuda_pipe(packages):
    pipe = edgespec.load(packages["llama_noisy"], provider="cuda")
    if pipe.target.providers[0] != "CUDAExecutionProvider":
        pytest.skip("the CUDA provider is listed but could not start")
    return pipe


def test_cuda_greedy_equals_cpu_target_only(cuda_pipe, packages):
    cpu = edgespec.load(packages["llama_noisy"], provider="cpu")
    for prompt in ("def add(a, b):", "The quick brown"):
        on_gpu = cuda_pipe.generate(prompt, max_new_tokens=32, draft_length=4)
        alone = cuda_pipe.generate(prompt, max_new_tokens=32, drafter="none")
        assert on_gpu.token_ids == alone.token_ids
        assert on_gpu.token_ids == cpu.generate(prompt, max_new_tokens=32, drafter="none").token_ids


def test_the_in_place_cache_stays_on_the_device(cuda_pipe):
    cache = cuda_pipe.target.new_cache()
    assert cuda_pipe.target.in_place
    assert all(buffer.device_name() == "cuda" for buffer in cache.buffers)


def test_a_cache_that_grows_stays_on_the_device_with_the_same_logits(cuda_pipe):
    """Growth copies the covered prefix through the host (kv_cache.py) into new device buffers."""
    session = cuda_pipe.target
    ids = np.random.default_rng(0).integers(0, session.vocab_size, size=40)
    small, whole = session.new_cache(2), session.new_cache(session.max_positions)
    for chunk in (ids[:3], ids[3:4], ids[4:20], ids[20:]):
        np.testing.assert_allclose(session.forward(chunk, small), session.forward(chunk, whole),
                                   atol=1e-4)
    assert small.capacity == 40 and whole.capacity == session.max_positions
    assert all(buffer.device_name() == "cuda" for buffer in small.buffers)


def test_draft_on_cpu_next_to_a_gpu_target(packages):
    pipe = edgespec.load(packages["llama_noisy"], provider="cuda", draft_provider="cpu")
    assert pipe.draft.providers == ["CPUExecutionProvider"]
    result = pipe.generate("def add(a, b):", max_new_tokens=16, draft_length=3)
    alone = pipe.generate("def add(a, b):", max_new_tokens=16, drafter="none")
    assert result.token_ids == alone.token_ids
