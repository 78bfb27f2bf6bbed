"""The engine over UlaCache (kv_tier): admission by the KV system's budgets, and outputs identical to the same
sparse model with every entry resident, through evictions and host round trips (slots poisoned with NaN)."""
import re

import pytest

from lanner import LLM, SamplingParams
from lanner.cli import build_parser, engine_kwargs
from lanner.config import EngineConfig
from lanner.engine.llm_engine import RequestError
from lanner.kvcache.ula.system import UlaKV

SPARSE = {"dtype": "float32", "sparse_budget": 32, "sparse_page": 16, "sparse_group": 10}
# 6 prompts of ~200 tokens: each decode query reads 2 of ~13 pages per layer group
PROMPTS = [f"Story {i}: " + " ".join(f"The {w} walked past house number {i * 7 + j}." for j, w in
                                     enumerate(["cat", "dog", "fox", "owl", "bee", "elk"] * 3)) + " Who walked first?"
           for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def kv_usage(engine) -> float:
    return float(re.search(rb"^lanner_kv_cache_usage_ratio (\S+)", engine.metrics.render(), re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def resident():
    """The same sparse decoding with every entry in one big device pool."""
    llm = LLM(kv_tier="gpu-only", kv_device_gb=1.0, **SPARSE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_ula_dp_admits_by_budget_and_matches_resident(resident):
    # fp32 entries of 10 layers: 15 KiB; ~210 tokens x 3 groups per request; device + host hold ~3 requests'
    # ranges and the device pool a tenth of that, so entries are evicted to the host and loaded back
    llm = LLM(kv_tier="ula-dp", kv_device_gb=0.005, kv_host_gb=0.03, kv_poison=True, **SPARSE)
    eng = llm.engine
    assert isinstance(eng.kv, UlaKV) and eng.config.spec is None
    cache = eng.kv.decoder.cache
    per_request = eng.kv.groups * (max(len(eng.make_request(p).prompt_ids) for p in PROMPTS) + GREEDY.max_tokens)
    fits = cache.max_requests(per_request)
    assert 2 <= fits < len(PROMPTS)
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    running, usage, outs = [], [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        running.append(len(eng.scheduler.running))
        usage.append(kv_usage(eng))
    assert max(running) == fits  # admission filled the budget and never went beyond it
    done = [outs[r.request_id] for r in reqs]
    assert all(o.error is None and o.finish_reason == "length" for o in done)
    assert [o.token_ids for o in done] == resident
    assert cache.stats["accesses"] > cache.stats["hits"] > 0  # misses: entries came back from the host
    assert not cache.requests and not eng.kv.decoder.reqs  # every range was released
    assert max(usage) > 0.5 and usage[-1] == 0.0  # /metrics: the share of device + host entries reserved


@pytest.mark.parametrize("spec", ["suffix", "draft"])
def test_speculation_over_ulacache_matches_sparse_decoding(resident, spec):
    """Drafts verified over UlaCache: suffix drafts, and the shipped draft head (its features captured by the sparse
    decoder, its KV in blocks of its own). Every draft token's query selects its own pages (their bounds hold the
    tokens up to it), rejected entries are rolled back, and greedy output equals the same sparse decoding without
    speculation, through evictions and host round trips (poisoned slots). (gpu-only with drafts:
    test_bench_kv_engine; ula-dp and hisparse rows against one-token steps: test_ula.py)"""
    n = 4 if spec == "suffix" else 3
    llm = LLM(kv_tier="ula-dp", kv_device_gb=0.006, kv_host_gb=0.03, kv_poison=True, spec=spec,
              draft="default" if spec == "draft" else None, **SPARSE)
    outs = llm.generate(PROMPTS[:n], GREEDY)
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] == resident[:n]
    steps = sum(o.metrics["spec_verify_steps"] for o in outs)
    accepted = sum(sum(o.metrics["spec_accepted_tokens"].values()) for o in outs)
    assert steps > 0 and accepted > 0  # drafts were verified, and some kept
    eng = llm.engine
    cache = eng.kv.decoder.cache
    assert not cache.requests and cache.stats["accesses"] > cache.stats["hits"]  # entries came back from the host
    assert not eng.spec.states  # per-request drafting state ends with its request
    if spec == "draft":  # every block the head took for its KV came back
        assert len(eng.proposer.free_blocks) * eng.config.block_size == eng.proposer.kv.shape[1] > 0


def test_hisparse_tier_matches_resident(resident):
    llm = LLM(kv_tier="hisparse", kv_device_gb=0.05, kv_host_gb=0.1, kv_poison=True, **SPARSE)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == resident[:3]


def test_ula_refusals():
    llm = LLM(kv_tier="ula-dp", kv_device_gb=0.005, kv_host_gb=0.005, **SPARSE)
    with pytest.raises(RequestError, match="kv_device_gb / kv_host_gb"):
        llm.engine.make_request("Hi " * 400, SamplingParams(max_tokens=16))
    # a request that fits still runs beside the refusal
    assert len(llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4))[0].token_ids) == 4
    for bad, match in [({"kv_tier": "nvme"}, "kv_tier"), ({"kv_tier": "ula-dp", "spec": "ngram", "draft": "x"}, "draft"),
                       ({"kv_tier": "ula-dp", "plugin": "lowlat"}, "plugins"),
                       ({"kv_tier": "ula-dp", "sparse_budget": 8}, "sparse_budget"),
                       ({"kv_tier": "ula-tp"}, "tp >= 2"), ({"kv_tier": "ula-dp", "tp": 2}, "use ula-tp")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="kv_device_gb"):
        LLM(kv_tier="ula-dp", kv_device_gb=0.0001, kv_host_gb=0.01, **SPARSE)
    args = build_parser().parse_args(["serve", "--kv-tier", "ula-dp", "--kv-host-gb", "2", "--sparse-budget", "128"])
    kw = engine_kwargs(args)
    assert (kw["kv_tier"], kw["kv_host_gb"], kw["sparse_budget"]) == ("ula-dp", 2.0, 128)
    assert EngineConfig(**kw).spec is None  # the default speculation steps aside


def test_bench_kv_engine(tmp_path):
    from lanner.cli import main

    out = tmp_path / "engine.json"
    main(["bench", "kv", "engine", "--dtype", "float32", "--doc-tokens", "200", "--gen", "8", "--requests", "5",
          "--docs", "2", "--budget", "32", "--device-gb", "0.02", "--host-gb", "0.04", "--spec", "suffix",
          "--systems", "gpu-only,ula-dp", "--json", str(out)])
    import json

    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    # hisparse verifies drafts in test_ula.py, row by row against one-token steps
    assert list(rows) == ["gpu-only", "gpu-only+suffix", "ula-dp", "ula-dp+suffix"]
    assert all(r["identical_to_gpu-only"] and not r["errors"] and r["requests"] == 5 for r in rows.values())
    assert all(r["tau"] > 1 and r["speedup_vs_plain"] > 0 for name, r in rows.items() if "+" in name)
    # equal budgets: the device pool alone holds fewer requests than device + host
    assert 1 <= rows["gpu-only"]["max_running"] < rows["ula-dp"]["max_running"]
    assert (tmp_path / "engine.png").stat().st_size > 0


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    from lanner.models.tiny import make_tiny_model

    return make_tiny_model("glm_moe_dsa", str(tmp_path_factory.mktemp("glm")), mtp=True)


def test_dsa_model_over_ula_dp_matches_the_paged_engine(glm_folder):
    """A GLM-5-architecture model (MLA latent, DSA indexer) served over UlaCache: its greedy tokens equal the
    paged-cache engine's (the same model, every latent resident), through evictions and host round trips."""
    import torch

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 160, (int(n),), generator=g).tolist() for n in (40, 57, 33, 61, 45, 52)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    paged = LLM(model=glm_folder, dtype="float32", skip_tokenizer=True, block_size=8, kv_cache_memory="0.01GiB",
                spec=None)
    want = [o.token_ids for o in paged.generate(prompts, params)]
    entry = 2 * 40 * 4  # fp32 latent of the 2 layers sharing a selection
    # the device pool holds 3 requests' step (3 x 2 groups' 16 selected + new token... per group at a time) and,
    # with the host, about 4 requests' ranges: 6 requests wait, run, evict and reload
    llm = LLM(model=glm_folder, dtype="float32", skip_tokenizer=True, kv_tier="ula-dp",
              kv_device_gb=60 * entry / 2 ** 30, kv_host_gb=580 * entry / 2 ** 30, kv_poison=True)
    eng = llm.engine
    assert isinstance(eng.kv, UlaKV) and eng.scheduler.max_batch == 3
    reqs = [eng.add_request(p, params) for p in prompts]
    running, outs = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        running.append(len(eng.scheduler.running))
    assert max(running) == 3
    got = [outs[r.request_id] for r in reqs]
    assert all(o.error is None for o in got)
    assert [o.token_ids for o in got] == want
    cache = eng.kv.decoder.cache
    assert cache.store.evicted > 0 and cache.store.loaded > 0  # host round trips
    assert not cache.requests and not eng.kv.decoder.reqs
    # the checkpoint's MTP layer drafting k = 2 (the UlaCache paper's setting), its features captured by the sparse
    # decoder: the same tokens (a device pool that also takes the verify steps' queries)
    mtp = LLM(model=glm_folder, dtype="float32", skip_tokenizer=True, kv_tier="ula-dp", spec="draft", draft="mtp",
              spec_tokens=2, kv_device_gb=200 * entry / 2 ** 30, kv_host_gb=580 * entry / 2 ** 30, kv_poison=True)
    outs = mtp.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics["spec_verify_steps"] for o in outs) > 10
    cache = mtp.engine.kv.decoder.cache
    assert cache.store.evicted > 0 and cache.store.loaded > 0


def test_dsa_model_over_ula_tp_with_two_ranks_matches_the_paged_engine(glm_folder):
    """tp=2 (gloo worker process): every rank decodes over its share of one address space (latent entries and
    indexer keys on rank address mod 2), rank 0 drives the worker's decoder calls; greedy tokens equal the
    single-process paged engine's, through evictions, host round trips and remote fetches."""
    import torch

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 160, (int(n),), generator=g).tolist() for n in (40, 57, 33, 61)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    paged = LLM(model=glm_folder, dtype="float32", skip_tokenizer=True, block_size=8, kv_cache_memory="0.01GiB",
                spec=None)
    want = [o.token_ids for o in paged.generate(prompts, params)]
    entry = 2 * 40 * 4
    # per rank: a home pool and a buffer of 40 entries each (2 requests' step), 200 host entries
    with LLM(model=glm_folder, dtype="float32", skip_tokenizer=True, tp=2, kv_tier="ula-tp",
             kv_device_gb=80 * entry / 2 ** 30, kv_host_gb=200 * entry / 2 ** 30, kv_poison=True) as llm:
        eng = llm.engine
        assert eng.scheduler.max_batch == 2
        got = llm.generate(prompts, params)
        assert all(o.error is None for o in got)
        assert [o.token_ids for o in got] == want
        cache = eng.kv.decoder.cache
        assert cache.stats["remote"] > 0 and cache.store.evicted > 0 and cache.store.loaded > 0
        assert not cache.requests
        eng.kv.decoder.cache.store.check()


def test_both_kv_systems_implement_the_kv_system_contract(llm32):
    """PagedKV and UlaKV each have every member of lanner.engine.kv_system.KVSystem, methods with its signatures,
    and the engine reaches its KV system through no other name."""
    import ast
    import inspect
    from pathlib import Path

    from lanner.engine import llm_engine
    from lanner.engine.kv_system import KVSystem

    ula = LLM(kv_tier="ula-dp", kv_device_gb=0.005, kv_host_gb=0.01, **SPARSE).engine.kv
    members = {n for n in dir(KVSystem) if not n.startswith("_")} | set(KVSystem.__annotations__)
    for kv in (llm32.engine.kv, ula):
        assert isinstance(kv, KVSystem)
        for name in members:
            assert hasattr(kv, name), f"{type(kv).__name__} lacks {name}"
            want = getattr(KVSystem, name, None)
            if inspect.isfunction(want):
                assert list(inspect.signature(getattr(kv, name)).parameters) == \
                       list(inspect.signature(want).parameters)[1:], f"{type(kv).__name__}.{name}"
    assert llm32.engine.kv.supports_trees and not ula.supports_trees
    with pytest.raises(ValueError, match="chains only"):
        ula.keep_path(None, 0, [0])
    used = {node.attr for node in ast.walk(ast.parse(Path(llm_engine.__file__).read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "kv"}
    assert used <= members, used - members
