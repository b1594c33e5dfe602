"""edgespec serve and llama-server on the same constrained requests, side by side in one run.

    python benchmarks/structured_peers.py --pkg PKG --gguf TARGET.gguf --llama BIN \
        [--draft-gguf DRAFT.gguf] [--tasks benchmarks/prompts/structured_tasks.jsonl] \
        [--repeats 3] [--max-tokens 320] [--threads 2] [--json OUT]

PKG: the edgespec package of the GGUF files (``edgespec models build qwen2.5-coder``, or
``edgespec export --target TARGET.gguf --draft DRAFT.gguf``); BIN: llama.cpp's build/bin with
llama-server. The tasks (a JSON line each) are of two kinds, as an app sends them:

- ``extract``: a document in the prompt and ``response_format`` ``json_schema`` (strict) of the
  fields to extract;
- ``tool``: ``tools`` and ``tool_choice`` (required, a named function, or auto).

Every request goes, in turns for each repeat, greedy (temperature 0), one at a time, to
``edgespec serve PKG`` with ``drafter`` "none" (constrained decoding without a draft) and with
the package's default drafter (``auto``: the draft model and the text's lookup chosen per
round, the grammar's forced tokens proposed without a draft run), and to ``llama-server -m
TARGET.gguf --jinja`` alone and, with --draft-gguf, with ``-md DRAFT.gguf`` (its draft-model
speculation at its defaults). The servers are started once and stay up; only one works at a time.

Per request: decode tokens/s as each server reports it (edgespec: the reply's
``edgespec.tokens_per_s``, new tokens over the decode's seconds, the prefill excluded;
llama-server: ``timings.predicted_per_second``, the same), whether the answer is valid
(jsonschema: the content against the task's schema; each tool call's arguments against its
tool's parameters, the name one of the tools'), the finish reason, and whether edgespec's two
runs gave the same answer (greedy identity). Printed per kind and over all tasks: median
tokens/s, the median of per-task ratios to edgespec's constrained target-only, and edgespec's
default against llama.cpp's better run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vs_llamacpp import load_average, machine_line  # noqa: E402

DEFAULT_TASKS = Path(__file__).parent / "prompts" / "structured_tasks.jsonl"
STARTUP_S = 600  # a server loading (and edgespec measuring its step costs) may take this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(command: list[str], port: int, log: Path):
    """A server process until the block ends; waits for GET /health to answer 200."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited ({process.returncode}); its log: {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not answer in {STARTUP_S} s; its log: {log}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def request_body(task: dict, max_tokens: int) -> dict:
    body = {"messages": task["messages"], "temperature": 0,
            "max_tokens": max_tokens, "seed": 1}
    for field in ("response_format", "tools", "tool_choice"):
        if field in task:
            body[field] = task[field]
    return body


def validity(task: dict, message: dict) -> tuple[bool, str]:
    """Whether the answer is what the task asked for, and why not."""
    if task["kind"] == "extract":
        schema = task["response_format"]["json_schema"]["schema"]
        try:
            jsonschema.validate(json.loads(message.get("content") or ""), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return False, f"content: {str(e).splitlines()[0][:120]}"
        return True, ""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in task["tools"]}
    calls = message.get("tool_calls") or []
    if not calls:
        return task["tool_choice"] == "auto", "no tool call"
    for call in calls:
        name = call["function"]["name"]
        if name not in tools:
            return False, f"unknown tool {name}"
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), tools[name])
        except (ValueError, jsonschema.ValidationError) as e:
            return False, f"{name} arguments: {str(e).splitlines()[0][:120]}"
    return True, ""


def answer_text(message: dict) -> str:
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]
    return json.dumps([message.get("content"), calls])


def ask(client: httpx.Client, url: str, body: dict, engine: str) -> dict:
    reply = client.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    if reply.status_code != 200:
        raise SystemExit(f"{engine} answered {reply.status_code}: {reply.text[:500]}")
    data = reply.json()
    choice = data["choices"][0]
    if engine.startswith("edgespec"):
        stats = data["edgespec"]
        rate, drafted, accepted = stats["tokens_per_s"], stats["drafted"], stats["accepted"]
        forced = stats.get("forced", 0)
    else:
        timings = data["timings"]
        rate = timings["predicted_per_second"]
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        forced = None
    return {"tokens_per_s": rate, "completion_tokens": data["usage"]["completion_tokens"],
            "finish_reason": choice["finish_reason"], "drafted": drafted, "accepted": accepted,
            "forced": forced, "message": choice["message"]}


def summarize(rows: list[dict], engines: list[str]) -> dict:
    summary = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        group = [r for r in rows if kind in ("all", r["kind"])]
        out = {}
        for engine in engines:
            drafted = sum(x["drafted"] or 0 for r in group for x in r["runs"][engine])
            accepted = sum(x["accepted"] or 0 for r in group for x in r["runs"][engine])
            out[engine] = {
                "tokens_per_s": statistics.median(r["median_tokens_per_s"][engine]
                                                  for r in group),
                "x_edgespec_none": statistics.median(
                    r["median_tokens_per_s"][engine] / r["median_tokens_per_s"]["edgespec_none"]
                    for r in group),
                "valid": sum(x["valid"] for r in group for x in r["runs"][engine]),
                "runs": sum(len(r["runs"][engine]) for r in group),
                "acceptance": accepted / drafted if drafted else None}
        llama = [e for e in engines if e.startswith("llamacpp")]
        best = max(llama, key=lambda e: out[e]["tokens_per_s"])
        out["headline"] = {"llamacpp_best": best,
                           "edgespec_over_llamacpp_best": out["edgespec_auto"]["tokens_per_s"]
                           / out[best]["tokens_per_s"]}
        summary[kind] = out
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pkg", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--draft-gguf")
    parser.add_argument("--llama", required=True, help="llama.cpp's build/bin")
    parser.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--logs", type=Path, default=Path("build/structured-peers"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    args.logs.mkdir(parents=True, exist_ok=True)
    edgespec_bin = shutil.which("edgespec") or sys.exit("edgespec is not on PATH")
    llama_server = str(Path(args.llama) / "llama-server")
    engines = {"edgespec_none": ("edgespec", {"drafter": "none"}),
               "edgespec_auto": ("edgespec", {}),
               "llamacpp_plain": ("llama", {})}
    if args.draft_gguf:
        engines["llamacpp_draft"] = ("llama_draft", {})
    ports = {name: free_port() for name in ("edgespec", "llama", "llama_draft")}
    llama_common = ["--host", "127.0.0.1", "-t", str(args.threads), "-c", "4096", "--jinja",
                    "-np", "1", "--no-webui"]
    commands = {
        "edgespec": [edgespec_bin, "serve", args.pkg, "--port", str(ports["edgespec"]),
                     "--max-tokens", str(args.max_tokens)],
        "llama": [llama_server, "-m", args.gguf, "--port", str(ports["llama"]), *llama_common],
        "llama_draft": [llama_server, "-m", args.gguf, "-md", args.draft_gguf or "",
                        "-td", str(args.threads), "--port", str(ports["llama_draft"]),
                        *llama_common]}
    rows = []
    with ExitStack() as stack, httpx.Client() as client:
        urls = {}
        for name in sorted({server_name for server_name, _ in engines.values()}):
            print(f"starting {name}: {' '.join(commands[name])}", flush=True)
            urls[name] = stack.enter_context(server(commands[name], ports[name],
                                                    args.logs / f"{name}.log"))
        models = {name: client.get(f"{url}/v1/models").json()["data"][0]["id"]
                  for name, url in urls.items()}
        for task in tasks:  # a first request each: compilers, allocations, step costs
            for engine, (name, extra) in engines.items():
                ask(client, urls[name], {**request_body(task, 16), "model": models[name],
                                         **extra}, engine)
            break
        for task in tasks:
            row = {"kind": task["kind"], "name": task["name"], "load_average_start": load_average(),
                   "runs": {engine: [] for engine in engines}}
            for _ in range(args.repeats):
                for engine, (name, extra) in engines.items():
                    run = ask(client, urls[name], {**request_body(task, args.max_tokens),
                                                   "model": models[name], **extra}, engine)
                    run["valid"], run["invalid_because"] = validity(task, run["message"])
                    row["runs"][engine].append(run)
            row["median_tokens_per_s"] = {e: statistics.median(x["tokens_per_s"] for x in v)
                                          for e, v in row["runs"].items()}
            row["edgespec_identical"] = all(
                answer_text(a["message"]) == answer_text(b["message"])
                for a, b in zip(row["runs"]["edgespec_none"], row["runs"]["edgespec_auto"]))
            rows.append(row)
            print(f"{task['kind']} {task['name']}: " + ", ".join(
                f"{e} {v:.1f}" for e, v in row["median_tokens_per_s"].items())
                + f"; valid {[sum(x['valid'] for x in v) for v in row['runs'].values()]}"
                + f"; identical {row['edgespec_identical']}", flush=True)
    summary = summarize(rows, list(engines))
    print(f"# {machine_line()}; {len(tasks)} tasks x {args.repeats}, greedy, "
          f"{args.max_tokens} tokens at most, {args.threads} threads")
    print(f"{'kind':<8}{'engine':<16}{'tok/s':>8}{'x none':>8}{'valid':>8}{'accept':>8}")
    for kind, out in summary.items():
        for engine in engines:
            e = out[engine]
            accept = "" if e["acceptance"] is None else f"{e['acceptance']:.2f}"
            print(f"{kind:<8}{engine:<16}{e['tokens_per_s']:>8.1f}{e['x_edgespec_none']:>7.2f}x"
                  f"{e['valid']:>4}/{e['runs']:<3}{accept:>8}")
        print(f"{kind:<8}edgespec auto / {out['headline']['llamacpp_best']}: "
              f"{out['headline']['edgespec_over_llamacpp_best']:.2f}x")
    identical = all(r["edgespec_identical"] for r in rows)
    print(f"edgespec's answers with and without drafting identical on every task: {identical}")
    if args.json:
        args.json.write_text(json.dumps({
            "summary": summary, "rows": rows, "identical": identical, "machine": machine_line(),
            "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
