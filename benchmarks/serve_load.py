"""Load on `edgespec serve`: requests/s, time to first token and tokens/s at 1, 4 and 8 clients.

Starts `edgespec serve` on a free loopback port (or uses --url), then for each client count
runs that many threads, each sending streamed completions back to back, fixed-length
(ignore_eos) so every request does the same work. Time to first token is measured from sending
the request to the first text chunk; tokens/s per request over its whole time (queueing
included, which is what a client sees); requests/s and tokens/s over the run's wall time.

    python benchmarks/serve_load.py --requests 16 --max-tokens 128
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model demo
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def read_lines(path):"]


def start_server(package: str | None, queue: int, extra: list[str] = (),
                 deadline_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`edgespec serve [PACKAGE] --port 0 --queue QUEUE EXTRA`, and its URL once it listens."""
    args = [sys.executable, "-m", "edgespec", "serve", "--port", "0", "--queue", str(queue),
            *extra]
    process = subprocess.Popen(args + ([package] if package else []), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    url, ready = None, threading.Event()

    def read() -> None:
        nonlocal url
        for line in process.stderr:
            found = re.search(r"^serving .* at (http://[^ ]+)/v1", line)
            if found:  # printed once the socket listens, after uvicorn's start-up lines
                url = found.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(deadline_s) or not url:
        process.kill()
        sys.exit(f"the server {' '.join(extra)} did not start")
    return process, url


def one_request(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = None, 0
    with http.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"] and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return {"ttft_s": first or total, "total_s": total, "tokens": tokens}


def run_level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    def client(index: int) -> list[dict]:
        with httpx.Client() as http:
            return [one_request(http, url, model, PROMPTS[(index + i) % len(PROMPTS)],
                                max_tokens)
                    for i in range(index, requests, clients)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    ttft = sorted(r["ttft_s"] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "requests_per_s": len(results) / wall,
        "ttft_median_ms": 1000 * statistics.median(ttft),
        "ttft_p90_ms": 1000 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "request_tokens_per_s_median": statistics.median(r["tokens"] / r["total_s"]
                                                         for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", help="package to serve (default: the demo pair)")
    parser.add_argument("--url", help="an already running server instead of starting one")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--requests", type=int, default=32, help="per client count")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    process, url = (None, args.url) if args.url else start_server(args.package, queue=16)
    try:
        one_request(httpx.Client(), url, args.model, PROMPTS[0], 8)  # warm-up
        rows = [run_level(url, args.model, int(c), args.requests, args.max_tokens)
                for c in args.clients.split(",")]
    finally:
        if process:
            process.terminate()
            process.wait(10)
    print(f"{args.requests} streamed requests of {args.max_tokens} tokens (greedy, ignore_eos) "
          "per row")
    print("| clients | requests/s | TTFT median | TTFT p90 | tokens/s (server) | "
          "tokens/s per request (median) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests_per_s']:.2f} | {r['ttft_median_ms']:.0f} ms | "
              f"{r['ttft_p90_ms']:.0f} ms | {r['tokens_per_s']:.0f} | "
              f"{r['request_tokens_per_s_median']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
