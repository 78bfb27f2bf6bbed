"""Soak: 48 chat requests, 16 at a time, through the official async client against the real server and model.
Greedy answers must equal the same request served alone (lowlat's batch-invariant kernels make a row's bits independent
of its batch)."""
import asyncio
import random
import time

import httpx
import openai
from conftest import serve

from lanner.config import EngineConfig
from lanner.engine.async_engine import AsyncEngine
from lanner.engine.llm_engine import LLMEngine
from lanner.server.app import build_app

MAX_TOKENS = 24
CONCURRENCY = 16
TOPICS = ["the moon", "volcanoes", "honey bees", "the Roman empire", "prime numbers", "rainbows", "penguins",
          "the internet", "coffee", "black holes", "tides", "photosynthesis", "chess", "the Nile", "glaciers",
          "electric cars", "dinosaurs", "the violin", "sleep", "bread"]
ASK = ["Tell me one fact about {}.", "Why is {} interesting?", "Explain {} to a child.", "What is {}?"]




def make_requests() -> list[dict]:
    """20 greedy requests (10 distinct prompts, each twice: once streamed) and 28 sampled ones."""
    rng = random.Random(0)
    reqs = []
    for i, topic in enumerate(TOPICS[:10]):
        prompt = ASK[i % len(ASK)].format(topic)
        for stream in (False, True):
            reqs.append({"key": prompt, "greedy": True, "stream": stream,
                         "messages": [{"role": "user", "content": prompt}], "temperature": 0})
    for i in range(28):
        prompt = rng.choice(ASK).format(rng.choice(TOPICS))
        req = {"key": prompt, "greedy": False, "stream": i % 4 == 0,
               "messages": [{"role": "user", "content": prompt}], "temperature": rng.choice([0.6, 0.8, 1.0]),
               "top_p": rng.choice([1.0, 0.9])}
        if i % 3 == 0:
            req["seed"] = i
        reqs.append(req)
    rng.shuffle(reqs)
    return reqs


async def chat(client: openai.AsyncOpenAI, model: str, req: dict) -> tuple[str, str, int]:
    """-> (content, finish_reason, completion_tokens), streamed or not."""
    kw = {k: v for k, v in req.items() if k in ("messages", "temperature", "top_p", "seed")}
    if not req["stream"]:
        r = await client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    text, reason, usage = "", None, None
    async for c in await client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, stream=True, **kw):
        if c.choices:
            text += c.choices[0].delta.content or ""
            reason = c.choices[0].finish_reason or reason
        usage = c.usage or usage
    return text, reason, usage.completion_tokens


def test_soak():
    # the default engine (lowlat, hybrid speculation) in float32, with lowlat's limits raised so that every step
    # (16 decodes, 256-token prefill chunks) runs on its batch-invariant kernels: a row's bits then do not depend on
    # its batch, on any CPU. This soak found the tokenizer race of test_tokenizer.py::test_chat_template_is_thread_safe
    lowlat = {"max_batch": 16, "max_rows": 256, "prefill_rows": 256}
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_num_seqs=16, max_num_batched_tokens=256,
                                                plugin_options={"lowlat": lowlat})))
    requests = make_requests()
    try:
        with serve(build_app(engine)) as base:
            async def main():
                client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
                model = engine.model_name
                t0 = time.perf_counter()
                reference = {}
                for req in requests:  # each greedy prompt alone first: the expected answer
                    if req["greedy"] and req["key"] not in reference:
                        reference[req["key"]] = (await chat(client, model, {**req, "stream": False}))[0]
                t_ref = time.perf_counter() - t0

                sem = asyncio.Semaphore(CONCURRENCY)

                async def limited(req):
                    async with sem:
                        return await chat(client, model, req)

                t0 = time.perf_counter()
                results = await asyncio.gather(*(limited(r) for r in requests))
                t_burst = time.perf_counter() - t0
                await client.close()
                return reference, results, t_ref, t_burst

            reference, results, t_ref, t_burst = asyncio.run(main())
            total = sum(n for _, _, n in results)
            print(f"\nsoak: {len(reference)} references in {t_ref:.1f}s; {len(results)} requests at concurrency "
                  f"{CONCURRENCY} in {t_burst:.1f}s ({total} tokens, {total / t_burst:.1f} tok/s)")

            mismatches = []
            for req, (text, reason, n) in zip(requests, results):
                assert reason in ("stop", "length"), (req, reason)
                assert 1 <= n <= MAX_TOKENS and (reason == "stop" or n == MAX_TOKENS), (req, reason, n)
                # empty content only when the very first token was EOS
                assert text.strip() or (reason == "stop" and n == 1), (req, text)
                if req["greedy"] and text != reference[req["key"]]:
                    mismatches.append((req["key"], req["stream"], text, reference[req["key"]]))
            assert not mismatches, mismatches

            assert httpx.get(base + "/health").status_code == 200
            e = engine.engine
            deadline = time.monotonic() + 10
            while (e.scheduler.running or e.scheduler.waiting or e.kv.block_manager.num_used) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            assert not e.scheduler.running and not e.scheduler.waiting and e.kv.block_manager.num_used == 0
            assert not e.requests
    finally:
        engine.shutdown()
