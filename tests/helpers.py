"""Helpers the model tests share (test modules never import each other)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np

from edgespec.config import SamplingConfig
from reference import penalize, process_logits

PROMPTS = [
    "def add(a, b):",
    "The quick brown",
    "Grüße aus Köln",
    "import numpy as np\nx =",
    "for i in range(10):\n    print(",
]
SAMPLED = {"T=1": dict(temperature=1.0), "top-p": dict(temperature=0.7, top_p=0.9)}


def exact_two_token_distribution(pipe, sampling: SamplingConfig, prompt: str) -> dict:
    """P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) from the target graph (each row penalized
    for its prefix if the sampling sets penalties); an EOS first token ends the text."""
    ids = pipe.encode(prompt)
    eos = set(pipe.manifest.eos_token_ids)

    def p_next(prefix: list[int]) -> np.ndarray:
        logits = pipe.target.forward(np.array(prefix), pipe.target.new_cache())[-1]
        return process_logits(penalize(logits, prefix, len(ids), sampling)[None], sampling)[0]

    joint = {}
    for t1, p1 in enumerate(p_next(ids)):
        if p1 == 0:
            continue
        if t1 in eos:
            joint[(t1,)] = p1
            continue
        for t2, p2 in enumerate(p_next([*ids, t1])):
            joint[(t1, t2)] = p1 * p2
    return joint


def two_token_samples(pipe, sampling: SamplingConfig, n: int, prompt: str, **settings
                      ) -> tuple[list[tuple], int, int]:
    """The first two tokens of n seeded generations whose first round drafts two tokens (a
    fixed k = 2), with the tokens drafted and accepted over all of them."""
    samples, drafted, accepted = [], 0, 0
    for seed in range(n):
        result = pipe.generate(prompt, max_new_tokens=3, draft_length=2, schedule="fixed",
                               seed=seed,
                               **asdict(sampling), **settings)
        samples.append(tuple(result.token_ids[:2]))
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    return samples, drafted, accepted


def texts_by_schedule(pipe, prompt: str, **settings) -> dict[str, list[int]]:
    """Token ids of one generation per schedule that always drafts (fixed k = 1, 2, 4, 8 and
    the heuristic), same settings and seed; each is checked to have drafted."""
    runs = {f"k={k}": pipe.generate(prompt, draft_length=k, schedule="fixed", **settings)
            for k in (1, 2, 4, 8)}
    runs["heuristic"] = pipe.generate(prompt, draft_length=4, schedule="heuristic", **settings)
    assert all(r.stats.drafted > 0 for r in runs.values())
    return {name: r.token_ids for name, r in runs.items()}


def conversation(pipe, prompt: str) -> list:
    """Prompts that reuse the last generation's text in each way a chat or a server meets:
    the same prompt again, its text and reply with more after (the next chat turn), the last
    prompt edited a few tokens before its end (a cache longer than what holds), and a prompt
    sharing only its first token (a trimmed history). Each is a function of the last prompt
    and the tokens generated from it."""
    more = pipe.tokenizer.encode(" and then", add_special_tokens=False).ids
    other = pipe.tokenizer.encode("x = 1", add_special_tokens=False).ids
    return [
        lambda last, out: pipe.encode(prompt),
        lambda last, out: list(last),  # the same again: all but the last token kept
        lambda last, out: [*last, *out, *more],  # the next turn
        lambda last, out: [*last[:-3], *more],  # edited: parts inside the kept text
        lambda last, out: [*last, *out[:3], *more[::-1]],  # parts inside the reply
        lambda last, out: [*last[:1], *other],  # only the first token in common
    ]


def reuse_mismatches(reusing, fresh, prompts: list[str], **settings) -> tuple[list, int, int]:
    """Run every prompt's conversation on both pipelines: the mismatches (step, with kept
    caches, fresh), and the positions reused and tokens drafted over all the steps."""
    mismatches, reused, drafted = [], 0, 0
    for prompt in prompts:
        reusing.prefix_cache.clear()
        last, out = None, None
        for step, make in enumerate(conversation(reusing, prompt)):
            ids = make(last, out)
            with_kept = reusing.generate(ids, **settings)
            alone = fresh.generate(ids, **settings)
            assert alone.stats.prompt_tokens_reused == 0
            if with_kept.token_ids != alone.token_ids:
                mismatches.append((prompt, step, with_kept.token_ids, alone.token_ids))
            reused += with_kept.stats.prompt_tokens_reused
            drafted += with_kept.stats.drafted
            last, out = ids, with_kept.token_ids
    return mismatches, reused, drafted


@contextmanager
def recorded_target_rows(pipe) -> Iterator[dict[tuple, list[np.ndarray]]]:
    """Every row of logits the target session computes while the block runs, by the tokens it
    scores (the prefix up to and including the row's own token): one entry each time that
    prefix was scored. (benchmarks/greedy_identity.py records with it too.) The kept caches
    are dropped first: the block's first generation prefills its whole prompt, so every
    position the cache covers was fed while recording."""
    pipe.prefix_cache.clear()
    rows: dict[tuple, list[np.ndarray]] = {}
    text: list[int] = []  # the tokens the cache holds, as fed
    forward_rows = pipe.target.forward_rows  # what every run of the session goes through

    def recording(tokens, cache, features=None, keep=0):
        start = cache.length
        del text[start:]
        text.extend(int(t) for t in tokens)
        logits, feature_rows = forward_rows(tokens, cache, features, keep=keep)
        first = start + len(tokens) - len(logits)  # a run keeping its last rows only
        for i, row in enumerate(logits):
            rows.setdefault(tuple(text[: first + i + 1]), []).append(row.copy())
        return logits, feature_rows

    pipe.target.forward_rows = recording
    try:
        yield rows
    finally:
        del pipe.target.forward_rows
