"""Time to the first token, turn by turn, of one conversation: with the caches the pipeline keeps
between turns and without them, and llama-server's ``cache_prompt`` on the same GGUF (issue 36).

The conversation: a document of about ``--document-tokens`` tokens (benchmarks/prompts/
perplexity_text.txt, cut) with a request to summarize it, then short follow-up questions; each
reply is ``-n`` greedy tokens and joins the history. edgespec's time to the first token is the
wall time from the call to the first streamed piece of text (prefill, a round, detokenizing);
llama-server's is its own ``timings.prompt_ms`` plus one ``predicted_per_token_ms``, with
``cache_prompt`` (its slot holding the last turn's text: the cached request goes first) and
without.

    python benchmarks/ttft.py --pkg PKG --json OUT.json [--gguf FILE --llama BIN] [--turns 10]

Standard library and edgespec only; llama-server listens on 127.0.0.1 for the run and is
stopped after it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    "Which three facts in it matter most?", "Say that again in one sentence.",
    "What would a skeptic ask about it?", "Give it a title.", "What is missing from it?",
    "Who would find it useful?", "Name one thing it gets right.", "Ask me a question about it.",
    "Summarize our conversation so far in two sentences.",
]


def load(pkg: str, slots: int):
    import edgespec
    from edgespec.runtime.providers import SessionConfig

    return edgespec.load(pkg, provider="cpu", target=SessionConfig("cpu"),
                         calibration_cache=False, prefix_cache_slots=slots)


def document(pipe, tokens: int) -> str:
    text = Path(__file__).with_name("prompts").joinpath("perplexity_text.txt").read_text()
    ids = pipe.encode(text)[:tokens]
    return pipe.tokenizer.decode(ids)


def edgespec_turn(pipe, messages: list[dict], n: int) -> tuple[float, str, dict]:
    start = time.perf_counter()
    stream = pipe.chat_stream(messages, max_new_tokens=n, temperature=0.0)
    first, pieces = None, []
    for piece in stream:
        if first is None and piece:
            first = time.perf_counter() - start
        pieces.append(piece)
    result = stream.result
    return first, "".join(pieces), {"prompt_tokens": result.stats.prompt_tokens,
                                     "reused": result.stats.prompt_tokens_reused,
                                     "prefill_s": result.stats.prefill_s}


class LlamaServer:
    def __init__(self, bin_dir: Path, gguf: str, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", gguf, "-t", str(threads), "-c", "8192",
             "-np", "1", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit("llama-server did not become ready in 120 s")

    def turn(self, prompt: str, n: int, cache: bool) -> tuple[float, dict]:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                           "cache_prompt": cache}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            timings = json.loads(reply.read())["timings"]
        return (timings["prompt_ms"] + timings["predicted_per_token_ms"]) / 1e3, timings

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pkg", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--gguf", help="the target's GGUF file, for llama-server")
    parser.add_argument("--llama", help="llama.cpp's build/bin")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("-n", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kept, cold = load(args.pkg, 1), load(args.pkg, 0)
    messages = [{"role": "user", "content": "Summarize this document in three sentences.\n\n"
                 + document(kept, args.document_tokens)}]
    server = LlamaServer(Path(args.llama), args.gguf, args.threads) if args.gguf else None
    turns = []
    try:
        for turn in range(args.turns):
            row = {"turn": turn + 1, "load_average_start": os.getloadavg()[0]}
            row["kept_s"], reply, row["kept"] = edgespec_turn(kept, messages, args.n)
            row["cold_s"], cold_reply, row["cold"] = edgespec_turn(cold, messages, args.n)
            row["same_reply"] = reply == cold_reply
            if server:
                text = kept.tokenizer.decode(kept.encode_chat(messages), skip_special_tokens=False)
                # cached first: its slot then holds the last turn's text, as in a chat
                row["llama_cached_s"], timings = server.turn(text, args.n, cache=True)
                row["llama_cached_prompt_n"] = timings["prompt_n"]
                row["llama_cold_s"], _ = server.turn(text, args.n, cache=False)
            turns.append(row)
            print(f"turn {turn + 1}: {row['kept']['prompt_tokens']} tokens; edgespec kept "
                  f"{row['kept_s']:.2f} s ({row['kept']['reused']} reused), cold "
                  f"{row['cold_s']:.2f} s" + (f"; llama-server cache_prompt "
                  f"{row['llama_cached_s']:.2f} s ({row['llama_cached_prompt_n']} prompt "
                  f"tokens run), cold {row['llama_cold_s']:.2f} s" if server else ""), flush=True)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
    finally:
        if server:
            server.stop()
    first = turns[0]["kept_s"]
    record = {"package": args.pkg, "gguf": args.gguf, "new_tokens": args.n,
              "document_tokens": args.document_tokens, "threads": args.threads,
              "follow_up_over_first_turn": [t["kept_s"] / first for t in turns[1:]],
              "turns": turns}
    print("follow-up turns' TTFT over the first turn's (kept caches): "
          + ", ".join(f"{r:.2f}" for r in record["follow_up_over_first_turn"]))
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
