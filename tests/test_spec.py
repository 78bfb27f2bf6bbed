"""Speculative decoding is lossless: greedy outputs are token-identical to plain decoding, sampled outputs have
the same distribution, and KV bookkeeping ends where plain decoding ends."""
import itertools
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoConfig, AutoModelForCausalLM

from lanner import LLM, SamplingParams
from lanner.cli import build_parser, engine_kwargs
from lanner.config import EngineConfig
from lanner.engine.sampling import processed_probs
from lanner.models.loader import ModelSource, default_model_path, load_config
from lanner.layers.rotary import RotaryEmbedding
from lanner.models.config import ModelConfig
from lanner.spec.draft_head import DraftHead, random_draft_head
from lanner.spec.proposers import DraftHeadProposer, NgramProposer

PROMPTS = [
    "Write a python function that checks whether a number is prime.",
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue",
    "Hi",
    "Explain photosynthesis to a ten year old.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# Now a loop version:\n",
    "List the planets of the solar system in order.",
    "Translate to French: The cat sits on the mat. The cat sits on the mat.",
    "What is 17 times 23?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(llm32):  # llm32 speculates by default: opt out per request
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False)
    outs = llm32.generate(PROMPTS, plain)
    assert all(o.metrics["spec_verify_steps"] == 0 for o in outs)
    return [o.token_ids for o in outs]


def test_speculation_is_on_by_default_with_the_shipped_head(llm32, plain_outputs, tmp_path):
    cfg = llm32.engine.config
    assert (cfg.spec, cfg.draft, cfg.spec_tokens) == ("hybrid", "default", 3)
    assert isinstance(llm32.engine.proposer.head, DraftHeadProposer)
    alone = [llm32.generate(p, GREEDY)[0] for p in PROMPTS[:4]]
    assert [o.token_ids for o in alone] == plain_outputs[:4]
    assert all(o.metrics["spec_verify_steps"] > 0 for o in alone)
    # the bundled model by path gets the head too; models it was not trained for get suffix drafts (no head)
    assert EngineConfig(model=default_model_path()).spec == "hybrid"
    assert (EngineConfig(model=str(tmp_path)).spec, EngineConfig(model=str(tmp_path)).draft) == ("hybrid", None)
    assert EngineConfig(spec=None).spec is None and EngineConfig(spec="none").draft is None
    assert (EngineConfig(spec="ngram").spec_tokens, EngineConfig(draft="hass").spec) == (5, "draft")
    assert engine_kwargs(build_parser().parse_args(["generate", "x", "--no-spec"]))["spec"] == "none"
    with pytest.raises(ValueError, match="spec_tokens"):
        EngineConfig(spec_tokens=9)
    # a combination where one field would be ignored is an error naming both, never a silent rewrite
    with pytest.raises(ValueError, match="draft: 'hass' is given but spec='ngram'"):
        EngineConfig(spec="ngram", draft="hass")
    with pytest.raises(ValueError, match="spec_tree: .* not with kv_tier"):
        EngineConfig(kv_tier="ula-dp", spec="suffix", spec_tree=4)


@pytest.fixture(scope="module")
def head_dir(llm32, tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "random-head"
    random_draft_head(llm32.engine.model_config, draft_vocab_size=2048, seed=1).save(str(path))
    return str(path)


def check_greedy_lossless(llm, plain_outputs):
    for k in (1, 6, 3):  # the shortest draft, the longest the chain allows, the default's length
        llm.engine.config.spec_tokens = k  # read every step, so one engine serves every k
        if k == 3:  # each prompt alone (CI time: the other lengths run in the batches only)
            alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
            assert [o.token_ids for o in alone] == plain_outputs, f"k={k} batch 1"
            assert all(o.metrics["spec_verify_steps"] > 0 for o in alone)
        for lo in (0, 4):
            mixed = llm.generate(PROMPTS[lo : lo + 4], GREEDY)
            assert [o.token_ids for o in mixed] == plain_outputs[lo : lo + 4], f"k={k} batch of 4"
        assert llm.engine.kv.block_manager.num_used == 0
    return alone


def test_ngram_greedy_is_lossless(plain_outputs):
    llm = LLM(dtype="float32", weights="dequantize", spec="ngram")
    alone = check_greedy_lossless(llm, plain_outputs)
    taus = [o.metrics["spec_accept_length"] for o in alone]
    assert max(taus) > 2.0 and min(taus) < max(taus)  # the repetitive prompt accepts far more: mixed lengths


def test_random_draft_head_greedy_is_lossless(plain_outputs, head_dir):
    llm = LLM(dtype="float32", weights="dequantize", spec="draft", draft=head_dir)
    check_greedy_lossless(llm, plain_outputs)


def test_head_rope_follows_the_targets_scaling(tmp_path):
    """A Llama-3-style target's rope_scaling reaches its head: config, rotary table, saved and loaded."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    target = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500000.0,
                         rope_scaling=scaling, max_position_embeddings=256)
    random_draft_head(target, draft_vocab_size=32).save(str(tmp_path / "head"))
    head = DraftHead.load(str(tmp_path / "head"))
    assert head.cfg.rope_scaling == scaling
    want = RotaryEmbedding(8, 256, 500000.0, scaling).cos
    assert torch.equal(head.rotary.cos, want) and not torch.equal(want, RotaryEmbedding(8, 256, 500000.0).cos)


def test_head_tree_greedy_is_lossless(plain_outputs):
    """EAGLE-2 trees from the shipped head (spec_tree): greedy output equals plain decoding for each prompt alone
    and in a batch of 4 with prefix-cache hits (the same prompts again), and the trees really branch."""
    llm = LLM(dtype="float32", weights="dequantize", spec="draft", draft="default", spec_tree=8)
    trees = []
    verify = llm.engine.spec.verify
    llm.engine.spec.verify = lambda it, logits: trees.append(it.draft.parents) or verify(it, logits)
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS[:4]]
    assert [o.token_ids for o in alone] == plain_outputs[:4]
    batch = llm.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in batch] == plain_outputs[:4]
    assert any(o.metrics["cached_prompt_tokens"] > 0 for o in batch)
    assert sum(1 for t in trees if t and t.count(-1) > 1) > len(trees) // 2  # most trees have several first tokens
    assert llm.engine.kv.block_manager.num_used == 0


def test_self_draft_model_accepts_everything_and_is_lossless(plain_outputs):
    llm = LLM(dtype="float32", weights="dequantize", spec="draft", draft=default_model_path(), spec_tokens=4,
              spec_max_batch=8)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    # a draft identical to the target is accepted nearly always: every chain position is exercised
    assert all(o.metrics["spec_accept_length"] > 3.5 for o in outs)
    assert all(o.metrics["spec_accepted_per_position"][3] > 0 for o in outs)


def test_opt_out_and_batch_limit_turn_drafting_off():
    llm = LLM(dtype="float32", weights="dequantize", spec="ngram", spec_max_batch=2)
    off = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, speculative=False))[0]
    assert off.metrics["spec_verify_steps"] == 0
    big = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # 4 running > spec_max_batch: the first steps decode plainly, drafting resumes as requests finish
    assert all(o.metrics["spec_verify_steps"] < 11 for o in big)


def test_ngram_lookup_prefers_longest_and_latest_match():
    ng = NgramProposer(min_n=1, max_n=3)
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3) == [7, 5, 2]  # "2 3" last seen before "7 5 2"
    assert ng.lookup([5, 6, 7], 2) == []
    assert ng.lookup([4, 4], 3) == [4]


# ---------------------------------------------------------------- sampling on a tiny random model

V = 16
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def tiny_model(path, seed):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sharpen the random logits: peaked, yet ~1000 cells of the 3-token joint are likely
        model.lm_head.weight.mul_(6)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_model(root / "target", 0)
    tiny_model(root / "draft", 1)
    cfg = load_config(ModelSource.resolve(str(root / "target")))[0]
    random_draft_head(cfg, draft_vocab_size=V, seed=2).save(str(root / "head"))
    return root, target


def exact_joint(model, params):
    """P(t1, t2, t3 | PROMPT) after the sampling transforms, by enumerating all 16^3 continuations."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=2)])
    with torch.no_grad():
        logits = model(seqs).logits.float()
    p = [processed_probs(logits[:, len(PROMPT) - 1 + i], [params] * len(seqs)) for i in range(3)]
    p1 = p[0][0]  # same prompt for every row
    p2 = p[1].view(V, V, V)[:, 0]  # row (t1, t2) -> P(t2 | t1); independent of t2 of the row
    p3 = p[2].view(V, V, V)  # P(t3 | t1, t2)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.reshape(-1).double()


@pytest.mark.parametrize("spec,temp,top_p", [("ngram", 1.0, 1.0), ("ngram", 0.7, 0.9), ("draft", 1.0, 1.0),
                                             ("draft", 0.7, 0.9), ("suffix-tree", 0.7, 0.9), ("head-tree", 1.0, 1.0)])
def test_sampled_distribution_is_unchanged(tiny, spec, temp, top_p):
    """Suffix drafts also come from the shared index of earlier outputs (the same prompt, 20,000 times); its trees
    then branch where the outputs did (several candidates per node). (Suffix chains verify as n-gram drafts do.)
    A random head's trees hold its top 4 children at each expanded node."""
    root, target = tiny
    params = SamplingParams(temperature=temp, top_p=top_p, max_tokens=3, ignore_eos=True)
    draft = {"draft": root / "draft", "head-tree": root / "head"}.get(spec)
    llm = LLM(model=str(root / "target"), dtype="float32", skip_tokenizer=True,
              spec="draft" if draft else spec.removesuffix("-tree"), spec_tokens=3, draft=draft and str(draft),
              max_num_seqs=256, spec_max_batch=256, max_num_batched_tokens=4096, kv_cache_memory="0.05GiB",
              seed=123, spec_tree=8 if spec.endswith("-tree") else 0)
    n = 20000
    trees = []  # the draft trees verification saw
    verify = llm.engine.spec.verify
    llm.engine.spec.verify = lambda it, logits: trees.append(it.draft.parents) or verify(it, logits)
    outs = llm.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == 3 for o in outs)
    assert sum(o.metrics["spec_verify_steps"] for o in outs) > n // 4  # drafts really were verified
    counts = np.bincount([o.token_ids[0] * V * V + o.token_ids[1] * V + o.token_ids[2] for o in outs],
                         minlength=V**3).astype(float)
    expected = exact_joint(target, params).numpy() * n
    small = expected < 5  # chi-square needs >= 5 expected per cell: pool the rare cells into one
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    assert exp[-1] >= 5 or obs[-1] == 0
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 0.001
    if spec.endswith("-tree"):  # the trees branch: several candidates per node were verified
        assert sum(p is not None and len(set(p)) < len(p) for p in trees) > n // 10


def test_tree_refused_for_draft_models(tiny):
    root, _ = tiny
    with pytest.raises(ValueError, match="spec_tree: draft trees come from the suffix index or a draft head"):
        LLM(model=str(root / "target"), dtype="float32", skip_tokenizer=True, spec="draft",
            draft=str(root / "draft"), spec_tree=4, kv_cache_memory="0.01GiB")


def test_prefix_cache_holds_only_verified_tokens_and_nothing_leaks(tiny):
    root, _ = tiny
    kw = dict(model=str(root / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB",
              block_size=4, max_num_seqs=32)
    plain, spec = LLM(**kw), LLM(spec="ngram", spec_tokens=5, **kw)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, size=int(rng.integers(3, 20))).tolist() for _ in range(200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for llm in (plain, spec):
        assert llm.engine.kv.block_manager.num_used == 0
    # the same verified token blocks, and only those, are named in both prefix caches
    assert set(plain.engine.kv.block_manager.hash_to_block) == set(spec.engine.kv.block_manager.hash_to_block)


def test_server_reports_acceptance_in_usage_and_metrics():
    import httpx
    import openai
    from conftest import serve

    from lanner.config import EngineConfig
    from lanner.engine.async_engine import AsyncEngine
    from lanner.engine.llm_engine import LLMEngine
    from lanner.server.app import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", spec="ngram", spec_tokens=4)))
    try:
        with serve(build_app(engine)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            r = client.chat.completions.create(model=engine.model_name, max_tokens=24, temperature=0,
                                               messages=[{"role": "user", "content": PROMPTS[1]}])
            usage = r.usage.model_dump()
            assert usage["spec_accept_length"] > 1.0
            assert len(usage["spec_accepted_per_position"]) == 4
            text = httpx.get(f"{url}/metrics").text
            steps = float(re.search(r"^lanner_spec_verify_steps_total (\S+)", text, re.MULTILINE).group(1))
            emitted = float(re.search(r"^lanner_spec_emitted_tokens_total (\S+)", text, re.MULTILINE).group(1))
            assert steps > 0 and abs(emitted / steps - usage["spec_accept_length"]) < 1e-6
            assert 'lanner_spec_accepted_tokens_total{position="1"}' in text
    finally:
        engine.shutdown()


def test_shipped_hass_head_is_lossless_and_accepted(plain_outputs):
    llm = LLM(dtype="float32", weights="dequantize", spec="draft", draft="hass", spec_tokens=4)
    outs = [llm.generate(p, GREEDY)[0] for p in PROMPTS[:4]]
    assert [o.token_ids for o in outs] == plain_outputs[:4]
    emitted = sum(o.metrics["spec_accept_length"] * o.metrics["spec_verify_steps"] for o in outs)
    tau = emitted / sum(o.metrics["spec_verify_steps"] for o in outs)
    assert tau > 1.1, tau  # trained (tau ~1.3 on the eval sets); an untrained head stays at ~1.0
