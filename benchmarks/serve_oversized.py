"""`edgespec serve` under a client that loops oversized prompts (issue 27's first probe): the
/tokenize latency another client sees, idle and during the loop, and the server's memory
(its process and its text child) before, during and after.

An oversized prompt passes the character cap and tokenizes to far more ids than the context
window (20,000 emoji: 80,000 ids with the demo's byte-level tokenizer); it must be refused from
its token count, with the tokenizer child left running, so that other clients do not wait for
a new child after every such request.

    python benchmarks/serve_oversized.py --seconds 20 [--prompt words]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx
from serve_load import start_server

# each passes the character cap (512 x 45 for the demo) and tokenizes past the window
OVERSIZED = {"emoji": "🙂" * 20_000,  # 80,000 bytes, 80,000 ids: past the bytes bound
             "words": "x " * 11_000}  # 22,000 bytes, 11,001 ids: counted by the child


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (the text child), in MB (Linux)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if stat.parent.name == str(pid) or int(fields[1]) == pid:
                status = (stat.parent / "status").read_text()
                total += int(status.split("VmRSS:")[1].split()[0])
        except (OSError, IndexError):
            continue
    return total / 1024


def tokenize_ms(http: httpx.Client, url: str, model: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        http.post(f"{url}/tokenize", json={"model": model, "prompt": "def f(x):"}).raise_for_status()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", help="a package folder (default: the demo pair)")
    parser.add_argument("--seconds", type=float, default=20, help="how long the loop runs")
    parser.add_argument("--samples", type=int, default=200, help="/tokenize calls per phase")
    parser.add_argument("--prompt", choices=sorted(OVERSIZED), default="emoji",
                        help="the oversized prompt the loop sends")
    args = parser.parse_args()
    process, url = start_server(args.package, queue=8)
    try:
        with httpx.Client(timeout=60) as http:
            model = http.get(f"{url}/v1/models").json()["data"][0]["id"]
            tokenize_ms(http, url, model, 20)  # warm
            before = rss_mb(process.pid)
            idle = tokenize_ms(http, url, model, args.samples)
            stop, answers = threading.Event(), {}

            def loop() -> None:
                with httpx.Client(timeout=60) as looping:
                    while not stop.is_set():
                        prompt = OVERSIZED[args.prompt]
                        for path, body in (("/v1/completions", {"prompt": prompt}),
                                           ("/tokenize", {"prompt": prompt})):
                            response = looping.post(f"{url}{path}",
                                                    json={"model": model, **body})
                            key = (path, response.status_code,
                                   response.json().get("error", {}).get("code"))
                            answers[key] = answers.get(key, 0) + 1

            looper = threading.Thread(target=loop)
            looper.start()
            time.sleep(1)  # the loop under way before measuring
            busy = tokenize_ms(http, url, model, args.samples)
            during = rss_mb(process.pid)
            time.sleep(max(0, args.seconds - 1))
            stop.set()
            looper.join()
            after = rss_mb(process.pid)
        print(f"/tokenize median: idle {statistics.median(idle):.2f} ms, during the loop "
              f"{statistics.median(busy):.2f} ms "
              f"({statistics.median(busy) / statistics.median(idle):.2f}x)")
        print(f"memory (server + child): {before:.1f} MB before, {during:.1f} MB during, "
              f"{after:.1f} MB after ({after - before:+.1f} MB)")
        for (path, status, code), n in sorted(answers.items()):
            print(f"  {n} x {path}: {status} {code}")
    finally:
        process.terminate()
        process.wait(30)


if __name__ == "__main__":
    main()
