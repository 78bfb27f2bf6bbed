"""Device-pool replacement policies (PB-LRU, exact LRU), Quest-style sparse decode, and `lanner bench kv`."""
import json
from collections import OrderedDict

import pytest
import torch

from lanner.kvcache.lru import PBLRU, ExactLRU


def reference_lru(trace, slots):
    """Textbook LRU over an OrderedDict: hit count for a trace of one address per step."""
    cache, hits = OrderedDict(), 0
    for a in trace:
        if a in cache:
            hits += 1
            cache.move_to_end(a)
        else:
            if len(cache) == slots:
                cache.popitem(last=False)
            cache[a] = None
    return hits


def local_trace(steps, per_step, num_addrs, seed):
    """Addresses with temporal locality: a drifting hot window plus uniform cold accesses."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        hot = (torch.randint(0, num_addrs // 8, (per_step * 3 // 4,), generator=g) + t * 7) % num_addrs
        out.append(torch.cat([hot, torch.randint(0, num_addrs, (per_step - hot.numel(),), generator=g)]))
    return out


def check_consistent(pol):
    resident = (pol.addr_slot >= 0).nonzero().flatten()
    assert (pol.slot_addr[pol.addr_slot[resident]] == resident).all()
    assert int((pol.slot_addr >= 0).sum()) == resident.numel() <= pol.num_slots


@pytest.mark.parametrize("make", [lambda n, a: ExactLRU(n, a), lambda n, a: PBLRU(n, a, num_buckets=512)])
def test_single_address_steps_match_textbook_lru(make):
    g = torch.Generator().manual_seed(1)
    trace = [int(x) for x in torch.randint(0, 60, (400,), generator=g)]
    pol = make(16, 60)
    for a in trace:
        pol.access(torch.tensor([a]))
    assert pol.hits == reference_lru(trace, 16)
    check_consistent(pol)


@pytest.mark.parametrize("policy", ["pb-lru", "lru"])
def test_plan_protects_the_step_and_maps_only_after_commit(policy):
    A, N = 5000, 600
    pol = PBLRU(N, A, num_buckets=8) if policy == "pb-lru" else ExactLRU(N, A)
    for addrs in local_trace(60, 250, A, seed=2):
        before = pol.addr_slot.clone()
        plan = pol.plan(addrs)
        needed = set(addrs.tolist())
        # nothing this step needs is evicted, and victims are distinct slots
        assert not needed & set(plan.evicted_addrs.tolist())
        assert plan.load_slots.unique().numel() == plan.load_slots.numel()
        # the mapping does not change before the data has moved (commit)
        assert torch.equal(pol.addr_slot, before)
        assert (pol.addr_slot[plan.load_addrs] == -1).all()
        pol.commit(plan)
        assert (pol.addr_slot[addrs] >= 0).all()
        check_consistent(pol)
    assert 0 < pol.hit_rate < 1


def test_pb_lru_hit_rate_close_to_exact_lru():
    A, N = 20000, 3000
    trace = local_trace(200, 256, A, seed=3)
    pb, lru = PBLRU(N, A, num_buckets=64), ExactLRU(N, A)
    for s in trace:
        pb.access(s)
        lru.access(s)
    assert lru.hit_rate > 0.3
    assert abs(pb.hit_rate - lru.hit_rate) < 0.01
    # too few buckets for the reuse distance: PB-LRU degrades, which the bucket count exists to prevent
    few = PBLRU(N, A, num_buckets=2)
    for s in trace:
        few.access(s)
    assert few.hit_rate < pb.hit_rate


def test_step_larger_than_pool_is_refused():
    with pytest.raises(ValueError, match="device pool has 4 slots"):
        PBLRU(4, 100).plan(torch.arange(5))
    with pytest.raises(IndexError, match="outside the address space"):
        ExactLRU(4, 100).plan(torch.tensor([100]))


# ------------------------------------------------------------------ Quest-style sparse decode

@pytest.fixture(scope="module")
def model32():
    from lanner.models.loader import ModelSource, load_model

    model, _ = load_model(ModelSource.resolve(None), torch.float32, "cpu")
    return model


def test_quest_full_budget_is_dense_and_small_budget_selects(model32):
    from lanner.bench.kv_quality import evaluate
    from lanner.kvcache.quest import QuestSelector, SparseSession

    g = torch.Generator().manual_seed(0)
    doc = torch.randint(100, 20000, (180,), generator=g).tolist()
    full = evaluate(model32, [doc], 160, 6, 16, 512, 1)
    assert full["top1_agreement"] == 1.0 and full["nll_sparse"] == pytest.approx(full["nll_dense"], abs=1e-6)
    sel = QuestSelector(model32.cfg.num_layers, page_size=16, budget=48, group=3)
    s = SparseSession(model32, 200, selector=sel)
    s.feed(doc[:160])
    s.feed([doc[160]])  # context 161 = pages 0..10, the last one partial
    assert len(sel.selected) == model32.cfg.num_layers // 3  # one selection per layer group
    for positions in sel.selected:
        p = positions[0]
        assert p.numel() == 2 * 16 + 1  # two full pages + the query's own page (1 token so far)
        assert 160 in p.tolist()
    sparse = evaluate(model32, [doc], 160, 6, 16, 48, 1)
    assert sparse["nll_sparse"] != full["nll_sparse"]


def test_bench_kv_trace_and_lru(tmp_path):
    """`lanner bench kv trace` records real sparse accesses on real text; `lanner bench kv lru` replays them."""
    from lanner.cli import main

    trace = tmp_path / "trace.jsonl"
    main(["bench", "kv", "trace", "--trace", str(trace), "--docs", "2", "--doc-tokens", "200", "--steps", "4",
          "--budget", "64", "--quality-budgets", "64", "--group", "10", "--out-dir", str(tmp_path),
          "--dtype", "float32"])
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 2 * 4 and len(lines[0]["groups"]) == 3  # 30 layers / 10 per group
    assert all(len(g) <= 64 + 16 for x in lines for g in x["groups"])
    q = json.loads((tmp_path / "bench_kv_trace.json").read_text())["quality"][0]
    assert q["budget"] == 64 and 0 <= q["top1_agreement"] <= 1
    main(["bench", "kv", "lru", "--trace", str(trace), "--out-dir", str(tmp_path), "--repeat", "1"])
    rows = json.loads((tmp_path / "bench_kv_lru.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"pb-lru", "lru"}
    assert {r["batch"] for r in rows} == {1, 2, 4, 8, 16}
    assert all(0 < r["hit_rate"] < 1 and r["sched_ms"] > 0 for r in rows)
    assert (tmp_path / "bench_kv_lru.png").exists()


def test_grouped_sdpa_equals_gqa_sdpa():
    """CUDA's attention path folds a KV group's query heads into query rows (no enable_gqa): same result."""
    import torch.nn.functional as F

    from lanner.layers.attention import sdpa_grouped

    g = torch.Generator().manual_seed(0)
    B, Q, H, Hkv, D, L = 3, 4, 9, 3, 16, 20
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((Q, H), (L, Hkv), (L, Hkv)))
    mask = torch.rand(B, 1, Q, L, generator=g) > 0.3
    mask[..., 0] = True
    for m in (mask, None):
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
                                             enable_gqa=True, scale=0.3).transpose(1, 2).reshape(B * Q, H * D)
        assert torch.allclose(sdpa_grouped(q, k, v, m, 0.3), ref, atol=1e-6)


@pytest.mark.parametrize("span", [1, 3])
def test_native_loops_make_the_pytorch_decisions(span):
    """The C++ lookup / recency update / victim walk (csrc/lru.cpp) against the PyTorch ops on the same trace:
    the same mapping after every step, through releases (free slots) and buckets expiring."""
    A, N = 6000, 700
    for make in (lambda native: PBLRU(N, A, num_buckets=8, span=span, native=native),
                 lambda native: ExactLRU(N, A, native=native)):
        fast, ref = make(True), make(False)
        for t, addrs in enumerate(local_trace(120, 300, A, seed=4)):
            pf, pr = fast.access(addrs), ref.access(addrs)
            assert torch.equal(pf.load_slots, pr.load_slots) and torch.equal(pf.load_addrs, pr.load_addrs)
            assert torch.equal(fast.addr_slot, ref.addr_slot)
            if t % 25 == 24:  # a request finishes: its entries' slots become free ones
                gone = torch.arange(t * 40, t * 40 + 400)
                assert torch.equal(fast.release(gone), ref.release(gone))
        if isinstance(fast, PBLRU):  # the bitmap's counts too (column 0 of each bucket is the sentinel's scratch)
            words = lambda p: p.count.view(p.B + 1, p.row)[:, 1:]
            assert torch.equal(words(fast), words(ref)) and torch.equal(fast.slot_epoch, ref.slot_epoch)
            assert torch.equal(fast.sizes, words(fast).sum(1))  # level 0 of the C++ path: slots per bucket
        assert fast.hits == ref.hits > 0
