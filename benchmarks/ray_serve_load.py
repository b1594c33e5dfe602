"""Ray Serve's cost: requests/s and p50/p95 latency at 1, 4 and 8 clients, for `edgespec serve`
as one process and on a local Ray Serve with 1 and 2 replicas (needs edgespec[ray]).

Each server is started in turn on a free loopback port and loaded with serve_load.py's
clients (streamed, fixed-length greedy completions, back to back); latency is a request's
whole time, queueing included. The replicas share the machine's cores: one replica gets all
of them (--replica-cpus), two get an equal share each, as do the one to two of ``rayauto``
(not run by default: which rows see the second replica depends on Ray's 30 s look-back).

    python benchmarks/ray_serve_load.py --requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_load import PROMPTS, one_request, start_server


def level(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    def client(index: int) -> list[float]:
        with httpx.Client() as http:
            return [one_request(http, url, "demo", PROMPTS[i % len(PROMPTS)],
                                max_tokens)["total_s"]
                    for i in range(index, requests, clients)]

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = sorted(t for ts in pool.map(client, range(clients)) for t in ts)
    wall = time.perf_counter() - begin

    def pct(q: float) -> float:
        return 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    return {"clients": clients, "requests_per_s": len(latencies) / wall, "p50_ms": pct(0.5),
            "p95_ms": pct(0.95), "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16, help="per client count")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--servers", default="one,ray1,ray2",
                        help="which of: one (one process), ray1, ray2 (Ray Serve replicas), "
                             "rayauto (--autoscale 1:2, adding a replica without delay)")
    args = parser.parse_args()
    cores = str(len(os.sched_getaffinity(0)))
    setups = {"one": ("one process", []),
              "ray1": ("Ray Serve, 1 replica", ["--replicas", "1", "--replica-cpus", cores]),
              "ray2": ("Ray Serve, 2 replicas", ["--replicas", "2",
                                                 "--replica-cpus", str(int(cores) / 2)]),
              "rayauto": ("Ray Serve, autoscale 1:2", ["--autoscale", "1:2", "--upscale-delay",
                                                      "0", "--replica-cpus",
                                                      str(int(cores) / 2)])}
    print(f"{args.requests} streamed requests of {args.max_tokens} tokens (greedy, ignore_eos) "
          f"per row; {cores} cores; load: the 1-minute load average after the row")
    print("| server | clients | requests/s | p50 | p95 | load |")
    print("|---|---|---|---|---|---|")
    for name, extra in (setups[key] for key in args.servers.split(",")):
        process, url = start_server(None, 16, extra, deadline_s=180)
        try:
            for _ in range(2):  # warm-up: each replica's first request
                one_request(httpx.Client(), url, "demo", PROMPTS[0], 8)
            for clients in args.clients.split(","):
                r = level(url, int(clients), args.requests, args.max_tokens)
                print(f"| {name} | {r['clients']} | {r['requests_per_s']:.2f} | "
                      f"{r['p50_ms']:.0f} ms | {r['p95_ms']:.0f} ms | {r['load']:.2f} |",
                      flush=True)
        finally:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
