"""UlaCache: logical addresses over a device pool + host tier (DP), a distributed address space (TP, 2 gloo
ranks), the gpu-only and HiSparse baselines, Quest-sparse decoding over them, and `lanner bench kv capacity`."""
import json
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lanner.kvcache.lru import PBLRU, ExactLRU
from lanner.kvcache.ula.quest_decoder import UlaDecoder, UlaSession
from lanner.kvcache.ula import CacheFull, GpuOnly, HiSparse, TieredStore, UlaDP, UlaTP, entry_shape

SHAPE = (2, 2, 1, 4)  # unit tests: an entry of 2 layers x (K, V) x 1 head x 4 dims
GB_PER_ENTRY = 16 * 4 / 2 ** 30  # float32


def rand_entries(n, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ policy and store mechanics

@pytest.mark.parametrize("make", [lambda: PBLRU(8, 20, num_buckets=4), lambda: ExactLRU(8, 20)])
def test_release_frees_slots_for_reuse_first(make):
    pol = make()
    for a in range(8):  # full, address a used at step a
        pol.access(torch.tensor([a]))
    freed = pol.release(torch.tensor([0, 1, 15]))  # 15 was never resident
    assert sorted(freed.tolist()) == sorted(pol.slot_addr.eq(-1).nonzero().flatten().tolist())
    assert freed.numel() == 2 and (pol.addr_slot[:2] == -1).all()
    p = pol.plan(torch.tensor([10, 11]))
    assert sorted(p.load_slots.tolist()) == sorted(freed.tolist()) and p.evicted_addrs.numel() == 0  # no eviction
    pol.commit(p)
    assert pol.plan(torch.tensor([12])).evicted_addrs.tolist() == [2]  # then the coldest as before


def test_tiered_store_moves_entries_between_tiers_and_stores_each_once():
    st = TieredStore(SHAPE, torch.float32, dev_slots=24, host_slots=80, poison=True)
    truth = rand_entries(100)
    st.grow(100)
    st.write(torch.arange(100), truth)  # more than the device holds: the oldest spill to the host
    st.check()
    assert st.evicted == 100 - 24 and int((st.host_slot >= 0).sum()) == 76
    g = torch.Generator().manual_seed(1)
    host_full = 0
    for _ in range(30):
        need = torch.randperm(100, generator=g)[:20]
        m = st.move(need, fresh=need[:0])
        host_full += m.eager  # evictions beyond the free host slots reuse the slots the loads vacate
        m.run()
        assert torch.equal(st.dev[m.slots_of(need)], truth[need])  # the step reads its data where the plan says
        m.finish()
        st.check()
        assert (st.policy.addr_slot[need] >= 0).all()
        assert torch.equal(st.read(torch.arange(100)), truth)  # wherever each entry is now, it is intact
    assert st.loaded > 50 and st.evicted > 100 and host_full > 0
    with pytest.raises(KeyError, match="never written"):
        st.grow(101)
        st.move(torch.tensor([100]), fresh=torch.tensor([], dtype=torch.long))
    st.release(torch.arange(50))
    st.check()
    assert len(st.host_free) + int((st.host_slot >= 0).sum()) == 80
    assert int(st.live.sum()) == 50


def test_data_arrives_before_the_mapping_and_early_reads_see_poison():
    st = TieredStore(SHAPE, torch.float32, dev_slots=4, host_slots=8, poison=True)
    truth = rand_entries(10, seed=2)
    st.grow(10)
    st.write(torch.arange(10), truth)  # 6..9 on the device, 0..5 on the host
    need = torch.tensor([0, 1, 2])
    m = st.move(need, fresh=need[:0])
    slots = m.slots_of(need)
    assert (st.policy.addr_slot[need] == -1).all()  # planned, not mapped
    m.run(slice(0, 1))  # layer 0 of the entries only (a prefetching step)
    assert torch.equal(st.dev[slots, 0], truth[need, 0])
    assert st.dev[slots, 1].isnan().all()  # layer 1 not there yet: a read now would see NaN, not stale data
    assert (st.policy.addr_slot[need] == -1).all()
    m.run(slice(1, None))
    m.finish()
    assert torch.equal(st.dev[st.policy.addr_slot[need]], truth[need])
    freed = st.policy.addr_slot[need]
    st.release(need)
    assert st.dev[freed].isnan().all()  # finished requests' slots are poisoned


def test_admission_follows_each_systems_memory_accounting():
    n_req = 30  # entries per request
    dev_gb, host_gb = 40 * GB_PER_ENTRY, 100 * GB_PER_ENTRY
    gpu = GpuOnly(SHAPE, torch.float32, dev_gb)
    hs = HiSparse(SHAPE, torch.float32, dev_gb, host_gb, buffer_entries=10)
    dp = UlaDP(SHAPE, torch.float32, dev_gb, host_gb)
    assert (gpu.max_requests(n_req), hs.max_requests(n_req), dp.max_requests(n_req)) == (1, 3, 4)
    assert dp.capacity == 140  # DP: device + host, nothing stored twice
    for cache in (gpu, hs, dp):
        for i in range(cache.max_requests(n_req)):
            cache.open(i, n_req)
        with pytest.raises(CacheFull):
            cache.open("one more", n_req)
        cache.close(0)  # a finished request's room is reused, at the same addresses
        assert cache.open("again", n_req) == 0
    assert dp.max_batch(budget=8, page=4) == 5 and hs.max_batch(budget=16, page=4) == 0  # buffer < a selection


# ------------------------------------------------------------------ sparse decoding over UlaCache

PROMPT, STEPS, G, BUDGET, PAGE = 200, 10, 10, 48, 16
MAX_LEN = PROMPT + STEPS + 1


@pytest.fixture(scope="module")
def model32():
    from lanner.models.loader import ModelSource, load_model

    torch.set_num_threads(1)
    model, _ = load_model(ModelSource.resolve(None), torch.float32, "cpu")
    return model


def greedy(session, doc):
    """Prompt, then STEPS greedy tokens: (tokens, logits of every step [STEPS + 1, V])."""
    logits = [session.feed(doc)[-1]]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(session.feed([tokens[-1]])[-1])
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def reference(model32):
    """The same Quest-sparse model with every entry resident (quest.SparseSession)."""
    from lanner.kvcache.quest import QuestSelector, SparseSession

    doc = torch.randint(100, 20000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    sel = QuestSelector(model32.cfg.num_layers, PAGE, BUDGET, G)
    tokens, logits = greedy(SparseSession(model32, MAX_LEN, 16, sel), doc)
    return doc, tokens, logits, [s[0] for s in sel.selected]


def assert_same_as_reference(reference, tokens, logits):
    _, ref_tokens, ref_logits, _ = reference
    assert logits.isfinite().all()
    assert tokens == ref_tokens
    # decode steps: the gathered entries give the resident model's logits; the prefill row differs only by the
    # reference computing the LM head over all prompt rows (a GEMM) and UlaCache over the last one
    assert (logits[1:] - ref_logits[1:]).abs().max() <= 1e-5
    assert (logits[0] - ref_logits[0]).abs().max() <= 1e-4


def entries_gb(model, n):
    shape = entry_shape(model, G)
    return n * math.prod(shape) * 4 / 2 ** 30


@pytest.mark.parametrize("system", ["ula-dp", "ula-dp-prefetch", "hisparse", "gpu-only"])
def test_sparse_decode_over_ula_cache_matches_resident_quest(model32, reference, system):
    """Float32, poisoned slots; the device pool holds about one layer group's selection, so every step evicts
    to the host and loads back (counted)."""
    shape = entry_shape(model32, G)
    dev, host = entries_gb(model32, 80), entries_gb(model32, 700)
    if system.startswith("ula-dp"):
        cache = UlaDP(shape, torch.float32, dev, host, poison=True)
    elif system == "hisparse":
        cache = HiSparse(shape, torch.float32, dev, host, buffer_entries=80, poison=True)
    else:
        cache = GpuOnly(shape, torch.float32, entries_gb(model32, 700), poison=True)
    session = UlaSession(model32, cache, MAX_LEN, PAGE, BUDGET, G, prefetch=system.endswith("prefetch"))
    tokens, logits = greedy(session, reference[0])
    assert_same_as_reference(reference, tokens, logits)
    assert [s[0].tolist() for s in session.dec.selected] == [s.tolist() for s in reference[3]]
    if system.startswith("ula-dp"):
        cache.store.check()
        assert cache.store.evicted > 3 * (PROMPT - 80) and cache.store.loaded > 2 * STEPS  # host round trips
        assert 0 < cache.stats["hits"] < cache.stats["accesses"]
    if system == "hisparse":
        assert cache.stats["loaded"] > 2 * STEPS


@pytest.mark.parametrize("system", ["ula-dp", "hisparse"])
def test_verify_steps_read_what_single_steps_read(model32, reference, system):
    """Several tokens per request and step (a speculative verify): each row's logits equal the one-token step's at
    its position, and a rejected draft token leaves no trace (its entry and its key's page bounds are rolled back)."""
    doc, ref_tokens, ref_logits, _ = reference
    # the device pool (ula-dp) / the request's buffer (hisparse) takes a step of 5 queries' worst case (5 x 48
    # entries), not the 3 x 211 stored: evictions
    shape, dev, host = entry_shape(model32, G), entries_gb(model32, 250), entries_gb(model32, 700)
    cache = UlaDP(shape, torch.float32, dev, host, poison=True) if system == "ula-dp" else \
        HiSparse(shape, torch.float32, dev, host, buffer_entries=250, poison=True)
    dec = UlaDecoder(model32, cache, PAGE, BUDGET, G, MAX_LEN)
    dec.prefill("r", doc, MAX_LEN)
    wrong = lambda i: (ref_tokens[i] + 7) % model32.cfg.vocab_size  # a draft token the target rejects
    rows, at = [], 0
    for keep, draft in ((3, True), (4, True), (3, False)):
        fed = ref_tokens[at : at + keep] + ([wrong(at + keep)] if draft else [])
        logits = dec.step(["r"], [fed], commit=not draft)
        rows.append(logits[:keep])
        if draft:
            assert logits[keep - 1].argmax() != fed[-1]
            dec.accept("r", PROMPT + at + keep)
        at += keep
    assert dec.length("r") == PROMPT + STEPS
    # a verify row's GEMMs have other shapes than a one-row step's: float32 rounding differs by ~1e-4; a query
    # that read other pages (a page bound that lost a token: one such bug) is off by 0.1-4
    assert (torch.cat(rows) - ref_logits[1:]).abs().max() <= 3e-4
    if system == "ula-dp":
        assert cache.store.evicted > 0 and cache.store.loaded > 0
    else:
        assert cache.stats["loaded"] > 0


def _tp_worker(rank, port, doc, out):
    from lanner.models.loader import ModelSource, load_model

    torch.set_num_threads(1)
    model, _ = load_model(ModelSource.resolve(None), torch.float32, "cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        shape = entry_shape(model, G)
        results = {}
        for prefetch in (False, True):
            # per rank: 60 home + 40 buffer device slots, 400 host slots; two ranks hold 3 x 211 entries
            cache = UlaTP(shape, torch.float32, entries_gb(model, 100), entries_gb(model, 400), buffer_frac=0.4,
                          poison=True)
            session = UlaSession(model, cache, MAX_LEN, PAGE, BUDGET, G, prefetch=prefetch)
            tokens, logits = greedy(session, doc)
            cache.store.check()
            results[prefetch] = {"tokens": tokens, "logits": logits, "stats": dict(cache.stats),
                                 "evicted": cache.store.evicted, "loaded": cache.store.loaded,
                                 "stored": int(cache.store.live.sum())}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_distributed_address_space_matches_resident_quest(model32, reference, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: a fork of this many-threaded process can hang in the child on a lock held at fork time
    mp.start_processes(_tp_worker, args=(port, reference[0], str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    groups = model32.cfg.num_layers // G
    for prefetch in (False, True):
        ranks = [torch.load(tmp_path / f"rank{r}.pt")[prefetch] for r in range(2)]
        for r in ranks:
            assert_same_as_reference(reference, r["tokens"], r["logits"])
            assert r["stats"]["remote"] > 0  # entries homed on the other rank were fetched
            assert r["evicted"] > 0 and r["loaded"] > 0  # and home pools went through the host tier
            assert 0 < r["stats"]["hits"] < r["stats"]["accesses"]  # the buffer was reused, not just refilled
        # entry t lives on rank t mod 2 only: the ranks' stores split the history, no copy of it anywhere
        assert sum(r["stored"] for r in ranks) == groups * (PROMPT + STEPS)


# ------------------------------------------------------------------ benchmark

def test_bench_kv_capacity(tmp_path):
    from lanner.cli import main

    eb = math.prod((G, 2, 3, 64)) * 4  # bytes of one float32 entry of the default model
    dev, host = 1400 * eb / 2 ** 30, 4800 * eb / 2 ** 30
    main(["bench", "kv", "capacity", "--doc-tokens", "160", "--gen", "24", "--docs", "1", "--budget", "32",
          "--decode-steps", "1", "--device-gb", str(dev), "--host-gb", str(host), "--hisparse-buffer", "160",
          "--out-dir", str(tmp_path), "--dtype", "float32"])
    result = json.loads((tmp_path / "bench_kv_capacity.json").read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["gpu-only", "hisparse", "ula-dp", "ula-tp"]
    req = result["request_bytes"]
    assert rows["gpu-only"]["admitted"] == int(1400 * eb // req) == 2
    assert rows["ula-dp"]["admitted"] == int(6200 * eb // req) == 11  # device + host
    assert rows["hisparse"]["admitted"] == 2  # device buffers: 1400 // (160 * 3)
    assert rows["ula-tp"]["admitted"] > rows["gpu-only"]["admitted"]
    for r in rows.values():
        assert r["next_refused"], r  # one more request than accounted does not fit
        assert r["peak_tok_s"] > 0 and r["tpot_ms"]["1"] > 0
    assert rows["ula-dp"]["moves"]["evicted"] > 0 and rows["ula-dp"]["tpot_ms_prefetch"]["1"] > 0
    assert (tmp_path / "bench_kv_capacity.png").exists()
