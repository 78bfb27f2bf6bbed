"""Scheduler, KV cache and sampling behaviour on the real default model (float32)."""
import pytest

from lanner import LLM, SamplingParams
from lanner.engine.llm_engine import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "Hi",
    "Write a haiku about autumn leaves falling in the quiet forest.",
    "List three prime numbers:",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Summarize the sentence above.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into French, Spanish and German.",
    "def add(a, b):",
    "Once upon a time, in a kingdom far away, there lived a dragon who",
]


@pytest.fixture(scope="module")
def alone(llm32):
    return [llm32.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_batch_of_8_mixed_lengths_equals_each_alone(llm32, alone):
    outs = llm32.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)


def test_prefix_cache_hits_give_same_output(llm32):
    conv = [{"role": "user", "content": "Tell me about the moon. " * 8}]
    first = llm32.chat(conv, GREEDY)[0]
    second = llm32.chat(conv, GREEDY)[0]
    assert second.metrics["cached_prompt_tokens"] > 0
    assert second.metrics["cached_prompt_tokens"] >= first.metrics["prompt_tokens"] - 16
    assert second.token_ids == first.token_ids
    # a multi-turn follow-up reuses the whole first turn
    turn2 = conv + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the sun?"}]
    out = llm32.chat(turn2, GREEDY)[0]
    assert out.metrics["cached_prompt_tokens"] >= first.metrics["prompt_tokens"] - 16


def test_chunked_prefill_and_preemption_keep_outputs(alone):
    # 14 blocks x 16 tokens cannot hold 8 requests at once: some must be preempted and recomputed;
    # a 32-token budget chunks every prefill
    per_token = 2 * 30 * 3 * 64 * 4  # layers x k|v x kv heads x head dim x float32
    # spec=None: the draft head's KV would share the budget; plugin=None: so would lowlat's buffers
    tiny = LLM(dtype="float32", kv_cache_memory=f"{14 * 16 * per_token / 2**30}GiB", max_num_batched_tokens=32,
               spec=None, plugin=None)
    assert tiny.engine.kv.num_blocks == 14
    outs = tiny.generate(PROMPTS, GREEDY)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert tiny.engine.kv.block_manager.num_used == 0  # nothing leaked
    assert tiny.engine.kv.block_manager.num_free == 14


def test_named_session_keeps_its_prefix_under_pressure():
    """An agent's main session, then two subagents, then the main session again, on 12 blocks of 16 tokens: the
    main turn (7 blocks) and one subagent's (6) fit, a second subagent's does not. Under LRU it evicts the main
    session's prefix (freed first); named sessions keep it and evict the newer subagent's."""
    per_token = 2 * 30 * 3 * 64 * 4  # layers x k|v x kv heads x head dim x float32
    main, subs = list(range(1000, 1096)), [list(range(2000, 2080)), list(range(3000, 3080))]

    def main_hit(named: bool) -> int:
        llm = LLM(dtype="float32", kv_cache_memory=f"{12 * 16 * per_token / 2**30}GiB", spec=None, plugin=None)
        assert llm.engine.kv.num_blocks == 12
        params = lambda s: SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, session=s if named else None)
        llm.generate(main, params("main"))
        for i, sub in enumerate(subs):
            llm.generate(sub, params(f"sub{i}"))
        again = llm.generate(main + [5, 6, 7], params("main"))[0]
        assert llm.engine.kv.block_manager.num_used == 0
        llm.close()
        return again.metrics["cached_prompt_tokens"]

    assert main_hit(named=True) == 96  # the main session's whole prefix
    assert main_hit(named=False) <= 16  # LRU kept at most its head block


def test_no_block_leak_and_abort(llm32):
    bm = llm32.engine.kv.block_manager
    eng = llm32.engine
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50)) for p in PROMPTS[:4]]
    eng.step()
    eng.step()
    assert bm.num_used > 0
    for r in reqs:
        eng.abort(r.request_id)
    assert bm.num_used == 0 and not eng.has_unfinished()


def test_seed_reproducible_and_batch_independent(llm32):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    a = llm32.generate("Tell me a story.", p)[0].token_ids
    b = llm32.generate(["Tell me a story.", "Another prompt here"], [p, SamplingParams(temperature=1.0, max_tokens=20)])
    assert b[0].token_ids == a
    c = llm32.generate("Tell me a story.", SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=99,
                                                           ignore_eos=True))[0].token_ids
    assert c != a


def test_top_k_1_is_greedy(llm32, alone):
    out = llm32.generate(PROMPTS[1], SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == alone[1]


def test_stop_strings_and_stop_token_ids(llm32, alone):
    tok = llm32.tokenizer
    full = tok.decode(alone[7])
    stop = full[10:16]
    out = llm32.generate(PROMPTS[7], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and full.startswith(out.text)
    out = llm32.generate(PROMPTS[7], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[alone[7][5]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == alone[7][:6]


def test_logprobs_top_n(llm32, alone):
    out = llm32.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 24
    for lp, tid in zip(out.logprobs, out.token_ids):
        assert lp["token_id"] == tid and len(lp["top"]) == 3
        assert lp["top"][0][0] == tid  # greedy picks the most likely token
        assert lp["logprob"] <= 0 and abs(lp["top"][0][1] - lp["logprob"]) < 1e-5


def test_penalties_change_repetitive_output(llm32):
    prompt = "Repeat after me: la la la la la la la la"
    plain = llm32.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    for kw in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.5}):
        pen = llm32.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw))[0].token_ids
        assert pen != plain, kw
        assert len(set(pen)) >= len(set(plain)), kw


def test_bad_requests_are_refused_with_the_field(llm32):
    eng = llm32.engine
    with pytest.raises(RequestError) as e:
        eng.add_request("x" * 10, SamplingParams(max_tokens=eng.max_model_len))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        eng.add_request(list(range(eng.max_model_len + 5)), SamplingParams(max_tokens=1))
    assert "context" in str(e.value)
    with pytest.raises(RequestError):
        eng.add_request("", SamplingParams())
    with pytest.raises(RequestError):
        eng.add_request([10**9], SamplingParams())
    for kw, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                      ({"max_tokens": 0}, "max_tokens"), ({"stop": [3]}, "stop")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert not eng.has_unfinished()
    assert llm32.generate("Hi", GREEDY)[0].finish_reason == "length"
