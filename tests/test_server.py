"""The OpenAI-compatible server, end to end: the real bundled model, a real uvicorn server on a free port,
the official openai client and raw httpx."""
import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from conftest import serve

from lanner.config import EngineConfig
from lanner.engine.async_engine import AsyncEngine, EngineDeadError
from lanner.engine.llm_engine import LLMEngine, RequestError
from lanner.engine.sampling import SamplingParams
from lanner.server.app import build_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]




@pytest.fixture(scope="module")
def srv():
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_num_seqs=16)))
    with serve(build_app(engine)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield type("Srv", (), {"base": base, "engine": engine, "client": client, "model": engine.model_name})
    engine.shutdown()


def wait_idle(engine: AsyncEngine, timeout: float = 10.0):
    """Until nothing is running or waiting and every KV block is free again (the idle value is 0: freed
    prefix-cache blocks count as free)."""
    e = engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not e.scheduler.running and not e.scheduler.waiting and e.kv.block_manager.num_used == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: running={len(e.scheduler.running)} waiting={len(e.scheduler.waiting)} "
                         f"used_blocks={e.kv.block_manager.num_used}")


def sse_events(lines) -> list:
    """Parses `data: ...` lines; returns the JSON payloads and the literal "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def metric(text: str, name: str, labels: str = "", default: float | None = None) -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert m or default is not None, f"{name}{labels} missing from /metrics"
    return float(m.group(1)) if m else default


# ---------------------------------------------------------------------------------------------- basics
def test_health_and_models(srv):
    r = httpx.get(srv.base + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [srv.model]


def test_chat_non_streaming(srv):
    r = srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=32, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    prompt_len = len(srv.engine.engine.tokenizer.apply_chat_template(QUESTION))
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 32
    # the same prompt again: its full blocks come from the prefix cache
    r2 = srv.client.chat.completions.create(messages=QUESTION, model=srv.model, max_tokens=32, temperature=0)
    assert r2.choices[0].message.content == choice.message.content
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_streaming_matches_non_streaming(srv):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name three primary colors."}]}]
    full = srv.client.chat.completions.create(model=srv.model, messages=messages, max_tokens=40, temperature=0)
    chunks = list(srv.client.chat.completions.create(model=srv.model, messages=messages, max_tokens=40,
                                                     temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    # the usage chunk comes last, with no choices, even though stream_options was not given
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streaming_raw_sse(srv):
    body = {"messages": QUESTION, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": False}}
    with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] > 0
    assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-3]["choices"][0]["delta"] == {}  # as OpenAI: the finish chunk's delta is empty
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(e["choices"][0]["delta"]) == {"content"} for e in events[1:-3])
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events[:-1])


def test_completions_non_streaming_and_streaming(srv):
    kw = {"model": srv.model, "prompt": "The three largest planets are", "max_tokens": 20, "temperature": 0}
    full = srv.client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    chunks = list(srv.client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # a token-id prompt and a one-element list of strings are the same request
    ids = srv.engine.engine.tokenizer.encode(kw["prompt"])
    assert srv.client.completions.create(**{**kw, "prompt": ids}).choices[0].text == full.choices[0].text
    assert srv.client.completions.create(**{**kw, "prompt": [kw["prompt"]]}).choices[0].text == full.choices[0].text


def test_metrics(srv):
    before = httpx.get(srv.base + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("lanner_time_to_first_token_seconds_count", "lanner_num_requests_waiting",
                 "lanner_kv_cache_usage_ratio", "lanner_prefix_cache_hit_rate", "lanner_generation_tokens_total"):
        metric(before.text, name)
    srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=8, temperature=0)
    after = httpx.get(srv.base + "/metrics").text
    for name in ("lanner_time_to_first_token_seconds_count", "lanner_generation_tokens_total",
                 "lanner_prompt_tokens_total"):
        assert metric(after, name) > metric(before.text, name), name
    assert metric(after, "lanner_kv_cache_usage_ratio") == 0  # nothing running any more
    assert metric(after, "lanner_num_requests_waiting") == 0


def test_api_key(srv):
    with serve(build_app(srv.engine, api_key="sekret")) as base:
        r = httpx.get(base + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION},
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0, timeout=60)
        r = good.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=4, temperature=0)
        assert r.choices[0].message.content
        assert httpx.get(base + "/health").status_code == 200  # /health and /metrics stay open
        assert httpx.get(base + "/metrics").status_code == 200


# ---------------------------------------------------------------------------------------------- bad input
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = [
    (CHAT, "{not json", None),
    (CHAT, {"model": "x"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": QUESTION, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"messages": QUESTION, "max_tokens": 10**6}, "max_tokens"),
    (CHAT, {"messages": QUESTION, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": QUESTION, "max_tokens": "many"}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
    (CHAT, {"messages": QUESTION, "temperature": -0.5}, "temperature"),
    (CHAT, {"messages": QUESTION, "top_p": 0}, "top_p"),
    (CHAT, {"messages": QUESTION, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": QUESTION, "stop": 5}, "stop"),
    (CHAT, {"messages": QUESTION, "stop": ["ok", 7]}, "stop"),
    (CHAT, {"messages": QUESTION, "stop": [""]}, "stop"),
    (CHAT, {"messages": QUESTION, "n": 2}, "n"),
    (CHAT, {"messages": QUESTION, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (CHAT, {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": QUESTION, "seed": "abc"}, "seed"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": "word " * 9000}, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p[4:]}-{b}"[:60] for p, b, _ in BAD_REQUESTS])
def test_bad_request(srv, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(srv.base + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_bad_request_through_openai_client(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=srv.model, messages=QUESTION, temperature=-1)
    assert e.value.param == "temperature"


def test_still_serving_after_bad_requests(srv):
    wait_idle(srv.engine)
    r = srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def test_queue_full_is_503(srv):
    sched = srv.engine.engine.scheduler
    # every new request now finds the queue full (free running slots count as negative queue)
    limit, sched.max_queue_len = sched.max_queue_len, -sched.max_num_seqs
    try:
        r = httpx.post(srv.base + CHAT, json={"messages": QUESTION, "max_tokens": 4}, timeout=60)
    finally:
        sched.max_queue_len = limit
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_overloaded"
    assert r.headers["retry-after"] == "1"
    assert httpx.post(srv.base + CHAT, json={"messages": QUESTION, "max_tokens": 4}, timeout=60).status_code == 200


# ---------------------------------------------------------------------------------------------- disconnects
LONG = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 1000,
        "ignore_eos": True, "temperature": 0}


def test_client_disconnect_mid_stream_frees_kv(srv):
    wait_idle(srv.engine)
    aborts = metric(httpx.get(srv.base + "/metrics").text, "lanner_requests_finished_total",
                    '{finish_reason="abort"}', default=0.0)
    with httpx.Client(timeout=60) as client, client.stream("POST", srv.base + CHAT,
                                                           json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        content_chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                content_chunks += 1
                if content_chunks == 3:
                    break
        assert srv.engine.engine.scheduler.running and srv.engine.engine.kv.block_manager.num_used > 0
    # leaving the block closes the connection mid-stream
    wait_idle(srv.engine, timeout=10)
    text = httpx.get(srv.base + "/metrics").text
    assert metric(text, "lanner_requests_finished_total", '{finish_reason="abort"}') == aborts + 1
    assert metric(text, "lanner_kv_cache_usage_ratio") == 0 and metric(text, "lanner_num_requests_running") == 0


def test_client_disconnect_non_streaming_frees_kv(srv):
    wait_idle(srv.engine)
    # the client gives up while the request is still generating: sampled, so that the suffix index cannot draft the
    # repetitive greedy story 7 tokens a step (1000 greedy tokens took 3.6 s here, sampled ones 13.6 s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base + CHAT, json=LONG | {"temperature": 1.0, "seed": 1}, timeout=httpx.Timeout(60, read=3))
    wait_idle(srv.engine, timeout=10)


# ---------------------------------------------------------------------------------------------- sampling
def test_chat_logprobs(srv):
    r = srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(x <= 0 for x in lps)
        assert tok.top_logprobs[0].token == tok.token and tok.logprob == pytest.approx(lps[0])  # greedy
        assert bytes(tok.bytes).decode() == tok.token
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    # streamed logprobs carry the same tokens
    chunks = list(srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=12,
                                                     temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_completion_logprobs(srv):
    r = srv.client.completions.create(model=srv.model, prompt="One, two, three,", max_tokens=6, temperature=0,
                                      logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0


def test_seed_reproducibility(srv):
    def run(seed):
        return srv.client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=16, temperature=0.8, seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    assert run(1234) == run(1234)
    pairs = [(run(a), run(b)) for a, b in ((1, 2), (3, 4), (5, 6))]
    assert any(x != y for x, y in pairs)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(srv, stream):
    greedy = srv.client.chat.completions.create(model=srv.model, messages=QUESTION, max_tokens=32, temperature=0)
    full = greedy.choices[0].message.content
    assert " Paris" in full
    kw = {"model": srv.model, "messages": QUESTION, "max_tokens": 32, "temperature": 0, "stop": ["zzz", " Paris"]}
    if stream:
        chunks = list(srv.client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        r = srv.client.chat.completions.create(**kw)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop" and "Paris" not in text
    assert text == full[: full.index(" Paris")]


# ---------------------------------------------------------------------------------------------- AsyncEngine itself
def test_async_engine_abort_on_early_exit(srv):
    """Breaking out of generate() aborts the request on the engine thread; validation errors surface at the
    first iteration, before anything is queued."""
    ae = srv.engine
    ids = ae.engine.tokenizer.apply_chat_template(LONG["messages"])

    async def main():
        n = 0
        stream = ae.generate(None, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), prompt_ids=ids)
        async for out in stream:
            n += len(out.delta_token_ids)
            if n >= 3:
                break
        await stream.aclose()
        with pytest.raises(RequestError) as e:
            async for _ in ae.generate("hi", SamplingParams(max_tokens=10**6)):
                pass
        assert e.value.param == "max_tokens"

    wait_idle(ae)
    asyncio.run(main())
    wait_idle(ae)


def test_dead_engine_reports_unhealthy(srv):
    dead = AsyncEngine(srv.engine.engine)  # an idle loop never touches the engine; shut it down at once
    dead.shutdown()
    assert not dead.is_healthy
    with serve(build_app(dead)) as base:
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + CHAT, json={"messages": QUESTION, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"

    async def gen():
        async for _ in dead.generate("hi", SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(gen())
