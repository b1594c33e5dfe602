"""The server's guards in-process (Starlette's test client): the Host check, JSON bodies only,
CORS, the API key, request ids, /metrics, /tokenize and /detokenize, the queue counting
tokenization, prompt and max_tokens bounds, the time limit, bounded chat templates, and the
faults of native libraries and packages answered as OpenAI errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import OpenAI
from serve_helpers import until, with_manifest, with_normalizer, with_template
from starlette.testclient import TestClient

import edgespec
from edgespec.errors import ManifestError
from edgespec.models import demo_package
from edgespec.serve import ServeConfig, build_app
from edgespec.serve.worker import NativeFault, Worker

PROMPT = "def fibonacci(n):"
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


def client_for(app, host: str = "localhost", **headers) -> TestClient:
    return TestClient(app, base_url=f"http://{host}", headers=headers)


def body(**fields) -> dict:
    return {"model": "demo", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code is None or error["code"] == code, error
    return error


@pytest.fixture(scope="module")
def client(demo):
    with client_for(build_app(demo)) as client:
        yield client


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_a_host_not_allowed_is_refused_in_openai_shape(client, host):
    """A DNS-rebinding page reaches the server under its own name."""
    response = client.get("/v1/models", headers={"host": host})
    assert_openai_error(response, 400, "host_not_allowed")
    response = client.post("/v1/completions", json=body(), headers={"host": host})
    assert_openai_error(response, 400, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"])
def test_loopback_names_are_answered(client, host):
    assert client.get("/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_and_any_host(demo):
    with client_for(build_app(demo, ServeConfig(allowed_hosts=("box.lan",))), "box.lan") as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"host": "localhost"}).status_code == 400
    with client_for(build_app(demo, ServeConfig(allowed_hosts=("*",))), "any.where") as c:
        assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_json_is_a_415(client, content_type):
    """A page can POST these types to any origin without a CORS preflight."""
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/completions", content=json.dumps(body()), headers=headers)
    assert_openai_error(response, 415, "unsupported_media_type")
    assert client.get("/health").json()["running"] == 0  # nothing generated


def test_json_with_a_charset_is_json(client):
    response = client.post("/v1/completions", content=json.dumps(body()),
                           headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200


def test_cors_is_off_unless_origins_are_allowed(demo, client):
    origin = "https://evil.example"
    preflight = {"origin": origin, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}
    response = client.options("/v1/completions", headers=preflight)
    assert response.status_code == 405 and "access-control-allow-origin" not in response.headers
    response = client.get("/v1/models", headers={"origin": origin})
    assert "access-control-allow-origin" not in response.headers

    config = ServeConfig(allowed_origins=("http://localhost:3000",))
    with client_for(build_app(demo, config)) as allowed:
        ok = allowed.options("/v1/completions", headers={
            **preflight, "origin": "http://localhost:3000"})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        refused = allowed.options("/v1/completions", headers=preflight)
        assert_openai_error(refused, 400, "origin_not_allowed")


def test_an_api_key_is_required_as_a_bearer_token(demo):
    with client_for(build_app(demo, ServeConfig(api_key=KEY))) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                        {"authorization": f"Basic {KEY}"}):
            response = c.post("/v1/completions", json=body(), headers=headers)
            assert_openai_error(response, 401, "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/models", "/metrics"):
            assert_openai_error(c.get(path), 401, "invalid_api_key")
        assert c.get("/health").status_code == 200  # liveness probes carry no key
        given = c.post("/v1/completions", json=body(),
                       headers={"authorization": f"Bearer {KEY}"})
        assert given.status_code == 200

        openai = OpenAI(base_url="http://localhost/v1", api_key=KEY, http_client=c,
                        max_retries=0)
        assert openai.completions.create(model="demo", prompt=PROMPT, max_tokens=2).choices
        wrong = OpenAI(base_url="http://localhost/v1", api_key="nope", http_client=c,
                       max_retries=0)
        with pytest.raises(Exception) as error:
            wrong.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
        assert type(error.value).__name__ == "AuthenticationError"


def test_a_request_id_is_echoed_or_given(client):
    response = client.post("/v1/completions", json=body(), headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    refused = client.get("/v1/models", headers={"x-request-id": "r1", "host": "evil.example"})
    assert refused.headers["x-request-id"] == "r1"  # errors too
    given = client.get("/v1/models", headers={"x-request-id": "bad id\twith spaces"})
    assert given.headers["x-request-id"] != "bad id\twith spaces"
    assert len(given.headers["x-request-id"]) == 32


def metric_samples(client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def test_metrics_are_prometheus_text(demo):
    with client_for(build_app(demo)) as client:  # its own counters, whatever ran before
        whole = client.post("/v1/completions", json=body(max_tokens=4)).json()
        with client.stream("POST", "/v1/completions",
                           json=body(max_tokens=4, stream=True)) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        streamed = json.loads(lines[-1][6:])["edgespec"]
        client.post("/v1/completions", content="x", headers={"content-type": "text/plain"})
        samples = metric_samples(client)
        completions = ("endpoint", "/v1/completions")
        assert samples[("edgespec_requests_total", (completions, ("status", "200")))] == 2
        assert samples[("edgespec_requests_total", (completions, ("status", "415")))] == 1
        both = [whole["edgespec"], streamed]
        for metric, stat in (("generation", "new_tokens"), ("draft", "drafted"),
                             ("accepted", "accepted")):
            assert samples[(f"edgespec_{metric}_tokens_total", ())] == sum(s[stat] for s in both)
        assert samples[("edgespec_prompt_tokens_total", ())] == 2 * len(demo.encode(PROMPT))
        assert samples[("edgespec_queue", (("state", "running"),))] == 0
        assert samples[("edgespec_time_to_first_token_seconds_count", ())] == 1
        assert samples[("edgespec_request_seconds_count", (completions,))] == 3
        client.get("/no/such/path/12345")
        assert "/no/such/path" not in client.get("/metrics").text  # no label per client path


def test_a_server_answers_each_conversation_from_its_kept_caches(chat_package):
    """Two conversations take turns through the chat API: each next turn starts from its own
    kept caches (two slots), answers what a pipeline keeping none answers (greedy, a fixed
    k that drafts), and /metrics counts the hits and the reused tokens."""
    pipe, fresh = edgespec.load(chat_package), edgespec.load(chat_package, prefix_cache_slots=0)
    histories, reused, drafted = {"a": [], "b": []}, [], 0
    with client_for(build_app(pipe, ServeConfig(cache_slots=2))) as client:
        for turn in range(2):
            for name, history in histories.items():
                history.append({"role": "user", "content": f"{name} says {turn}"})
                out = client.post("/v1/chat/completions", json={
                    "model": "chat", "messages": history, "temperature": 0, "max_tokens": 6,
                    "draft_length": 2, "schedule": "fixed"}).json()
                expected = fresh.generate(pipe.encode_chat(history), max_new_tokens=6,
                                          draft_length=2, schedule="fixed")
                assert out["choices"][0]["message"]["content"] == expected.text, out
                reused.append(out["edgespec"]["prompt_tokens_reused"])
                drafted += out["edgespec"]["drafted"]
                history.append({"role": "assistant", "content": expected.text})
        samples = metric_samples(client)
    assert reused[:2] == [0, 0] and all(n > 0 for n in reused[2:]) and drafted > 0
    assert samples[("edgespec_prefix_cache_hits_total", ())] == 2
    assert samples[("edgespec_prompt_tokens_reused_total", ())] == sum(reused)
    assert samples[("edgespec_prefix_cache_bytes", ())] == pipe.prefix_cache.nbytes > 0


def test_tokenize_and_detokenize(client, demo):
    ids = demo.encode(PROMPT)
    out = client.post("/tokenize", json={"model": "demo", "prompt": PROMPT}).json()
    assert out == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    back = client.post("/detokenize", json={"model": "demo", "tokens": ids}).json()
    assert back == {"prompt": demo.tokenizer.decode(ids, skip_special_tokens=False)}
    assert_openai_error(client.post("/detokenize", json={"model": "demo", "tokens": [10**6]}),
                        400)
    assert_openai_error(client.post("/tokenize", json={"model": "demo"}), 400)
    assert_openai_error(client.post("/tokenize", json={"model": "x", "prompt": "a"}), 404,
                        "model_not_found")
    assert_openai_error(client.post("/tokenize", json={"model": "demo", "messages": [
        {"role": "user", "content": "hi"}]}), 400, "chat_template_missing")


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(demo):
    app = build_app(demo)
    server = app.state.server
    limit = server.max_prompt_chars
    assert limit == 512 * 45  # the context window times the longest token (45 characters)
    calls, encode = [], server.text.encode

    async def counting(text):
        calls.append(len(text))
        return await encode(text)

    server.text.encode = counting
    with client_for(app) as c:
        response = c.post("/v1/completions", json=body(prompt="x" * (limit + 1)))
        error = assert_openai_error(response, 400, "context_length_exceeded")
        assert f"{limit + 1} characters" in error["message"] and error["param"] == "prompt"
        assert calls == []
        fits = c.post("/v1/completions", json=body(prompt="x" * 100))
        assert fits.status_code == 200 and calls == [100]  # tokenized once


@pytest.mark.parametrize("name", ["demo", "bos"])
def test_the_child_tokenizes_as_the_pipeline_does(demo, chat_package, tmp_path, name):
    if name == "bos":  # a package whose tokenizer adds BOS to plain prompts
        pkg = with_manifest(chat_package, tmp_path / "bos", add_bos_token=True)
        pipe, model = edgespec.load(pkg), "bos"
    else:
        pipe, model = demo, "demo"
    prompts = [PROMPT, " leading space", "Grüße 東京 🙂\n\tx", "<|endoftext|>x"]
    with client_for(build_app(pipe)) as c:
        for prompt in prompts:
            out = c.post("/tokenize", json={"model": model, "prompt": prompt}).json()
            assert out["tokens"] == pipe.encode(prompt), prompt


def test_max_tokens_is_capped_by_the_server(demo):
    with client_for(build_app(demo, ServeConfig(max_tokens=8))) as c:
        error = assert_openai_error(c.post("/v1/completions", json=body(max_tokens=9)), 400)
        assert error["param"] == "max_tokens" and "at most 8" in error["message"]
        assert c.post("/v1/completions", json=body(max_tokens=8)).status_code == 200


def test_a_generation_past_its_time_limit_ends_as_at_max_tokens(demo):
    with client_for(build_app(demo, ServeConfig(request_timeout_s=0.05))) as c:
        out = c.post("/v1/completions", json=body(max_tokens=480, ignore_eos=True,
                                                  schedule="fixed")).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["edgespec"]["finish_reason"] == "time_limit"
    assert 0 < out["usage"]["completion_tokens"] < 480


def test_tokenizing_holds_a_place_in_the_queue(demo):
    """Requests are admitted before their prompts are tokenized: with one place, a second
    request while the first is still being tokenized is a 429."""
    app = build_app(demo, ServeConfig(queue=0))
    server = app.state.server
    encode = server.text.encode

    async def scenario():
        entered, release = asyncio.Event(), asyncio.Event()

        async def slow(text):
            entered.set()
            await release.wait()
            return await encode(text)

        server.text.encode = slow
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            first = asyncio.create_task(http.post("/v1/completions", json=body()))
            await entered.wait()
            assert server.worker.counts()["waiting"] == 1
            second = await http.post("/v1/completions", json=body())
            release.set()
            first = await first
        await server.text.close()
        return second, first

    second, first = asyncio.run(scenario())
    assert_openai_error(second, 429, "queue_full")
    assert first.status_code == 200


def test_a_tokenizer_panic_is_a_500_not_a_hung_request(tmp_path):
    pkg = with_normalizer(demo_package(), tmp_path / "demo",
                          {"type": "Replace", "pattern": {"Regex": "(a+)+b"}, "content": "b"})
    with client_for(build_app(edgespec.load(pkg))) as c:
        response = c.post("/v1/completions", json=body(prompt="a" * 40))
        error = assert_openai_error(response, 500, "tokenizer_error")
        assert "PanicException" in error["message"]
        assert c.post("/v1/completions", json=body()).status_code == 200  # it goes on
        assert c.get("/health").json()["waiting"] == 0  # the place was given back


def test_a_panic_inside_a_generation_fails_the_job_instead_of_hanging_it():
    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    class Panicking:
        result = None

        def cancel(self):
            pass

        def __iter__(self):
            yield "x"
            raise PanicException("regex: retry-limit-in-match over")

    async def scenario():
        worker = Worker(queue=0)
        job = worker.submit(Panicking())
        try:
            await asyncio.wait_for(job.result(), 5)
        finally:
            worker.close()
        return worker

    with pytest.raises(NativeFault, match="PanicException: regex"):
        asyncio.run(scenario())


def test_a_package_error_during_generation_is_a_500(demo, monkeypatch):
    app = build_app(demo)

    def broken(*args, **kwargs):
        raise ManifestError("target/model.onnx returned no logits; re-export the pair")

    with client_for(app) as c:
        monkeypatch.setattr(demo.target, "forward_rows", broken)  # what the target's runs call
        error = assert_openai_error(c.post("/v1/completions", json=body()), 500, "package_error")
        assert "re-export" in error["message"] and error["type"] == "server_error"
        with c.stream("POST", "/v1/completions", json=body(stream=True)) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["code"] == "package_error"
        assert lines[-1] == "data: [DONE]"


def test_a_stream_whose_client_leaves_is_cancelled_even_if_nothing_is_sent(demo):
    """ASGI 2.4 servers do not tell Starlette's StreamingResponse of a disconnect until it
    writes: the app watches for one itself."""
    app = build_app(demo)
    worker = app.state.server.worker

    async def scenario():
        sent, receipts = [], asyncio.Queue()
        request = json.dumps(body(max_tokens=480, ignore_eos=True, stream=True)).encode()
        await receipts.put({"type": "http.request", "body": request, "more_body": False})
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 8000),
                 "headers": [(b"host", b"localhost"), (b"content-type", b"application/json")]}

        async def receive():
            return await receipts.get()

        async def send(message):
            sent.append(message)
            if len(sent) == 2:  # the response started and one piece arrived: the client goes,
                await receipts.put({"type": "http.disconnect"})
                # and this send returns only once the generation is cancelled: a write that
                # never comes back cannot be what tells the app
                await until(lambda: worker.counts()["cancelled"] == 1, "cancelled")

        await asyncio.wait_for(app(scope, receive, send), 30)
        return worker.counts()

    counts = asyncio.run(scenario())
    assert counts["cancelled"] == 1 and counts["completed"] == 0


@pytest.mark.parametrize("messages, param, message", [
    (None, "prompt", "prompt is required"),
])
def test_a_missing_prompt_says_it_is_required(client, messages, param, message):
    error = assert_openai_error(client.post("/v1/completions", json={"model": "demo"}), 400)
    assert error["message"] == message and error["param"] == param


def test_stop_limits_are_said_as_they_are(client):
    error = assert_openai_error(client.post("/v1/completions", json=body(
        stop=["a", "b", "c", "d", "e"])), 400)
    assert error["param"] == "stop" and "at most 4 stop sequences, got 5" in error["message"]
    error = assert_openai_error(client.post("/v1/completions", json=body(stop="s" * 300)), 400)
    assert "at most 256 characters" in error["message"]


# Chat templates: each a 400 naming the template, quickly, whatever it does
HOSTILE_TEMPLATES = {
    "nested ranges": "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}"
                     "{% endfor %}",
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
    "string times": "{{ 'x' * 10**8 }}",
    "strftime": "{{ strftime_now('%s' * 10**6) }}",
    "long strftime": "{{ strftime_now('%Y' * 1000) }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "power": "{{ 10 ** 100000000 }}",
    "doubling": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}"
                "{% endif %}{% endmacro %}{{ f('x', 40) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "center": "{{ 'x'|center(999999999) }}",
    "output": "{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}",
    "undefined": "{{ messages[0].nothing.deeper }}",
    "attribute": "{{ messages.__class__.__mro__ }}",
}


@pytest.fixture(scope="module")
def hostile(chat_package, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    apps = {}
    for name, source in HOSTILE_TEMPLATES.items():
        pkg = with_template(chat_package, root / name.replace(" ", "_"), source)
        apps[name] = build_app(edgespec.load(pkg), ServeConfig(template_timeout_s=1.0))
    return apps


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_template_is_a_400_naming_it(hostile, name):
    with client_for(hostile[name]) as c:
        model = hostile[name].state.server.model
        response = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        error = assert_openai_error(response, 400, "chat_template_error")
        assert "chat_template.jinja" in error["message"] and error["param"] == "messages"
        assert "\n" not in error["message"]
        health = c.get("/health").json()
        assert health["running"] == health["waiting"] == 0


def test_usage_counts_the_users_prompt_not_the_healed_one(client, demo):
    prompt = "for i in range(10):\n"  # ends on a newline token, which longer ones extend
    out = client.post("/v1/completions", json=body(prompt=prompt, max_tokens=4)).json()
    assert out["edgespec"]["healed"]  # the generation backed off the last token
    assert out["edgespec"]["prompt_tokens"] == len(demo.encode(prompt)) - 1
    assert out["usage"]["prompt_tokens"] == len(demo.encode(prompt))


def test_a_chat_takes_at_most_the_servers_max_tokens_by_default(chat_package):
    pipe = edgespec.load(chat_package)
    with client_for(build_app(pipe, ServeConfig(max_tokens=5))) as c:
        out = c.post("/v1/chat/completions", json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 5
    assert out["choices"][0]["finish_reason"] == "length"
