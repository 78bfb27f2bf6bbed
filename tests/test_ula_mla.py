"""UlaCache under the tiny GLM-5-architecture model (MLA latent KV + DSA indexer, layers sharing a selection):
the latent entries live in gpu-only / HiSparse / UlaCache DP / UlaCache TP (2 gloo ranks, heads split) backends,
the indexer's top-k decides what a decode step fetches, and the result must be the plain resident model's."""
import json
import math
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.kvcache.ula.mla_decoder import MlaDecoder, mla_entry_shape, mla_kv_bytes, selection_groups
from lanner.kvcache.ula import CacheFull, GpuOnly, HiSparse, UlaDP, UlaTP
from lanner.models.loader import ModelSource, load_model
from lanner.models.tiny import make_tiny_model

MAX_LEN = 80
PROMPTS = {"a": (40, 1), "b": (57, 2), "c": (33, 3)}  # name: (tokens, seed); all longer than index_topk (16)
# a and b decode together, a finishes, c takes its room (freed, poisoned slots) and decodes with b
PHASES = ((("a", "b"), 6), (("b", "c"), 4))
STEPS = {"a": 6, "b": 10, "c": 4}


def prompt(name):
    n, seed = PROMPTS[name]
    return torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(folder):
    torch.set_num_threads(1)
    return load_model(ModelSource.resolve(folder), torch.float32, "cpu")[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("glm_moe_dsa", str(tmp_path_factory.mktemp("glm")))


@pytest.fixture(scope="module")
def model(folder):
    return load(folder)


def resident_greedy(model):
    """The plain model over its own (resident) caches: per prompt, its greedy tokens and every step's logits."""
    out = {}
    runner = ModelRunner(model, 16, 8, torch.float32, "cpu")
    for name in PROMPTS:
        ids, table = prompt(name), list(range(16))
        logits = [runner.run([SeqChunk(ids, 0, table, "last")])[0]]
        tokens = []
        for _ in range(STEPS[name]):
            tokens.append(int(logits[-1].argmax()))
            logits.append(runner.run([SeqChunk([tokens[-1]], len(ids) + len(tokens) - 1, table, "last")])[0])
        out[name] = (tokens, torch.stack(logits))
    return out


@pytest.fixture(scope="module")
def reference(model):
    return resident_greedy(model)


def pool_of(cache):
    return cache.store.dev if isinstance(cache, UlaDP) else cache.dev


def run_scenario(dec) -> dict:
    """PHASES over a decoder: per request its greedy tokens and logits, and how many device slots that were
    poisoned when a finished were later holding live data."""
    logits, tokens, out = {}, {}, {}
    poisoned = None
    for names, steps in PHASES:
        for n in names:
            if n not in logits:
                logits[n], tokens[n] = [dec.prefill(n, prompt(n), MAX_LEN)], []
        for _ in range(steps):
            for n in names:
                tokens[n].append(int(logits[n][-1].argmax()))
            for n, row in zip(names, dec.step(list(names), [tokens[n][-1] for n in names])):
                logits[n].append(row)
        pool = pool_of(dec.cache)
        if poisoned is not None:  # before the last requests finish (and poison their slots again)
            out["reused_poisoned"] = int(pool[poisoned].flatten(1).isfinite().all(1).sum())
        for n in [n for n in names if len(tokens[n]) == STEPS[n]]:
            dec.close(n)
            out[n] = (tokens.pop(n), torch.stack(logits.pop(n)))
        if poisoned is None:  # a's slots, and every slot free or evicted: NaN
            poisoned = pool.flatten(1).isnan().any(1).nonzero().flatten()
    return out


def assert_same_as_resident(reference, got):
    for name, (ref_tokens, ref_logits) in reference.items():
        tokens, logits = got[name]
        assert logits.isfinite().all(), name
        assert tokens == ref_tokens, name
        assert (logits - ref_logits).abs().max() <= 1e-5, name


def entries(model, n):
    return n * math.prod(mla_entry_shape(model)) * 4 / 2 ** 30


def test_entries_follow_the_selection_groups(model):
    assert selection_groups(model) == [[0, 1], [2, 3]]  # GLM-5: each indexer layer and the shared layer after it
    assert mla_entry_shape(model) == (2, 32 + 8)  # the group's 2 layers' latent (kv_lora_rank + rope)
    b = mla_kv_bytes(model, tp=2)
    assert (b["latent"], b["index_keys"]) == (4 * 40 * 4, 2 * 16 * 4)
    assert b["per_rank_replicated"] == 640 + 128 and b["per_rank_ula_tp"] == (640 + 128) / 2


def test_index_key_budget_refuses_admission(model):
    per_req = 2 * MAX_LEN  # entries (groups x max_len), one indexer key each
    dec = MlaDecoder(model, GpuOnly(mla_entry_shape(model), torch.float32, entries(model, 10 * per_req)), MAX_LEN,
                     index_gb=2 * per_req * 16 * 4 / 2 ** 30)
    pre = dec.run_prefill(prompt("c"))
    dec.add(0, pre, MAX_LEN)
    dec.add(1, pre, MAX_LEN)
    with pytest.raises(CacheFull, match="indexer keys"):
        dec.add(2, pre, MAX_LEN)
    dec.close(0)
    dec.add(2, pre, MAX_LEN)


@pytest.mark.parametrize("system", ["gpu-only", "hisparse", "ula-dp", "ula-dp-prefetch"])
def test_sparse_mla_decode_over_ula_cache_matches_resident_model(model, reference, system):
    """Float32, poisoned slots. ula-dp: a device pool of one batch-2 selection (2 x (topk + 1) entries), so every
    step evicts to the host and loads back; gpu-only: exactly two requests' entries, so c reuses a's slots."""
    shape = mla_entry_shape(model)
    if system.startswith("ula-dp"):
        cache = UlaDP(shape, torch.float32, entries(model, 34), entries(model, 300), poison=True)
    elif system == "hisparse":
        cache = HiSparse(shape, torch.float32, entries(model, 48), entries(model, 320), buffer_entries=24,
                         poison=True)
    else:
        cache = GpuOnly(shape, torch.float32, entries(model, 2 * 2 * MAX_LEN), poison=True)
    dec = MlaDecoder(model, cache, MAX_LEN, prefetch=system.endswith("prefetch"))
    got = run_scenario(dec)
    assert_same_as_resident(reference, got)
    assert got["reused_poisoned"] > 0  # poisoned slots came back into use, with their new data
    if system.startswith("ula-dp"):
        cache.store.check()
        assert cache.store.evicted > 100 and cache.store.loaded > 2 * 20  # host round trips, every step
        assert 0 < cache.stats["hits"] < cache.stats["accesses"]
    if system == "hisparse":
        assert cache.stats["loaded"] > 2 * 20


def test_verify_steps_read_what_single_steps_read(model, reference):
    """Several tokens per request and step (a speculative verify; two requests feeding different counts): every
    row's logits equal the resident model's at its position, each query selecting over the context up to it, and
    a rejected draft token leaves no trace. The device pool holds one step's worst case (7 queries x (topk + 1)),
    not the 2 x 160 entries stored: evictions and host round trips."""
    cache = UlaDP(mla_entry_shape(model), torch.float32, entries(model, 7 * 17), entries(model, 320), poison=True)
    dec = MlaDecoder(model, cache, MAX_LEN)
    ref = {n: reference[n] for n in ("a", "b")}
    nxt = {n: int(dec.prefill(n, prompt(n), MAX_LEN).argmax()) for n in ref}
    assert all(nxt[n] == ref[n][0][0] for n in ref)
    rows, at = {n: [] for n in ref}, {n: 0 for n in ref}
    wrong = lambda t: (t + 7) % model.cfg.vocab_size  # a draft token the target rejects
    for keep in ({"a": 2, "b": 3}, {"a": 3, "b": 1}, {"a": 1, "b": 4}):  # tokens each request keeps this step
        fed = {n: ref[n][0][at[n] : at[n] + keep[n]] + [wrong(int(ref[n][1][at[n] + keep[n]].argmax()))] for n in ref}
        logits = dec.step(list(ref), [fed[n] for n in ref], commit=False)
        off = 0
        for n in ref:
            rows[n].append(logits[off : off + keep[n]])
            assert logits[off + keep[n] - 1].argmax() != fed[n][-1]
            off += len(fed[n])
            at[n] += keep[n]
            dec.accept(n, len(prompt(n)) + at[n])
    for n in ref:  # the resident logits after the prompt's last token and after each kept token
        assert dec.length(n) == len(prompt(n)) + at[n]
        assert (torch.cat(rows[n]) - ref[n][1][1 : at[n] + 1]).abs().max() <= 1e-4, n
    cache.store.check()
    assert cache.store.evicted > 0 and cache.store.loaded > 0


def _tp_worker(rank, port, folder, out):
    import torch.distributed as dist

    from lanner.distributed import destroy_tp, init_tp

    torch.set_num_threads(1)
    init_tp(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        model = load(folder)  # heads split over the 2 ranks; latent and indexer replicated
        cache_group = dist.new_group(backend="gloo")  # the cache's own: a prefetch thread's gathers stay ordered
        results = {"reference": resident_greedy(model), "heads": model.layers[0].self_attn.num_heads,
                   "replicated_latent_bytes": sum(c[0][0].numel() * 4 for c in
                                                  ModelRunner(model, 1, 1, torch.float32, "cpu").kv_caches)}
        for prefetch in (False, True):
            # per rank: 35 home + 35 buffer device slots (a batch-2 selection, the worst case all on one rank)
            # and 140 host slots: two ranks hold two requests' 2 x 160 entries only together
            cache = UlaTP(mla_entry_shape(model), torch.float32, entries(model, 70), entries(model, 140),
                          buffer_frac=0.5, poison=True, group=cache_group)
            got = run_scenario(MlaDecoder(model, cache, MAX_LEN, prefetch=prefetch))
            cache.store.check()
            got.update(stats=dict(cache.stats), evicted=cache.store.evicted, loaded=cache.store.loaded)
            results[prefetch] = got
        # every request closed: the stores are empty; one more request, then what this rank stores per token
        dec = MlaDecoder(model, cache, MAX_LEN)
        logits = dec.prefill("b", prompt("b"), MAX_LEN)
        results["stored_entries"] = int(cache.store.live.sum())
        for _ in range(3):  # each rank's mirrors of the other's buffer policy, after some steps
            logits = dec.step(["b"], [int(logits.argmax())])[0]
        results["buffer_tables"] = [pol.addr_slot.clone() for pol in cache.bufpols]
        results["entry_bytes"] = cache.entry_bytes
        results["index_key_rows"], results["addresses"] = dec.index_keys.shape[0], cache.space.top
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        destroy_tp()


def test_tp2_mla_latent_stored_once_matches_resident_tp_model(model, folder, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: a fork of this many-threaded process can hang in the child on a lock held at fork time
    mp.start_processes(_tp_worker, args=(port, folder, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    n_b = PROMPTS["b"][0]
    for r in ranks:
        assert r["heads"] == 2  # the model really runs split: 2 of 4 heads per rank
        for prefetch in (False, True):
            got = r[prefetch]
            assert_same_as_resident(r["reference"], got)  # the plain TP model over its replicated caches
            assert got["reused_poisoned"] > 0
            assert got["stats"]["remote"] > 0  # entries homed on the other rank were fetched
            assert got["evicted"] > 0 and got["loaded"] > 0  # and home pools went through the host tier
            assert 0 < got["stats"]["hits"] < got["stats"]["accesses"]  # the buffer was reused, not just refilled
        # the plain TP model stores the whole latent on every rank: 4 layers x 40 floats per token
        assert r["replicated_latent_bytes"] == 4 * 40 * 4
    stored = [r["stored_entries"] for r in ranks]
    assert sum(stored) == 2 * n_b  # every entry of the prompt stored once across the ranks ...
    assert abs(stored[0] - stored[1]) <= 2  # ... split evenly (address mod 2)
    per_token = [s * ranks[0]["entry_bytes"] / n_b for s in stored]  # latent bytes per token on each rank
    assert sum(per_token) == ranks[0]["replicated_latent_bytes"]  # vs that on *each* rank when replicated
    # the indexer keys too are stored once: each rank holds rows for half of the addresses (and the selection,
    # merged from both ranks' top-k over their own keys, gave the resident model's outputs above)
    for r in ranks:
        assert r["index_key_rows"] == -(-r["addresses"] // 2) > 0
    # what a rank misses is known to the others without a request: their mirror of its buffer is exact
    for r in range(2):
        assert (ranks[r]["buffer_tables"][r] >= 0).any()
        assert torch.equal(ranks[r]["buffer_tables"][r], ranks[1 - r]["buffer_tables"][r])


def test_bench_kv_capacity_glm_tiny(tmp_path):
    from lanner.cli import main

    dev, host = 0.0004, 0.004
    main(["bench", "kv", "capacity", "--kv-model", "glm-tiny", "--doc-tokens", "200", "--gen", "16", "--docs", "1",
          "--budget", "32", "--decode-steps", "1", "--device-gb", str(dev), "--host-gb", str(host),
          "--out-dir", str(tmp_path), "--dtype", "float32"])
    result = json.loads((tmp_path / "bench_kv_capacity.json").read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["gpu-only", "hisparse", "ula-dp", "ula-tp", "hisparse-tp", "gpu-only-tp"]
    per_req = result["request_bytes"] + result["request_index_key_bytes"]  # every system keeps the indexer keys
    assert rows["gpu-only"]["admitted"] == int(dev * 2 ** 30 // per_req)
    assert rows["gpu-only-tp"]["admitted"] == int(dev / 2 * 2 ** 30 // per_req)  # each rank: everything, half budget
    assert rows["ula-dp"]["admitted"] > rows["hisparse"]["admitted"] > rows["gpu-only"]["admitted"]
    assert rows["ula-tp"]["admitted"] > rows["gpu-only-tp"]["admitted"]
    # HiSparse under TP holds the whole (replicated) history on every rank: half the budget per copy
    assert rows["ula-tp"]["admitted"] > rows["hisparse-tp"]["admitted"] > 0
    assert result["ratios"]["ula-tp/hisparse-tp"]["admitted"] == rows["ula-tp"]["admitted"] / rows["hisparse-tp"][
        "admitted"]
    for r in rows.values():
        assert r["next_refused"] and r["limit"], r
        assert r["peak_tok_s"] > 0 and r["tpot_ms"]["1"] > 0
    assert rows["ula-dp"]["moves"]["evicted"] > 0 and rows["ula-tp"]["moves"]["remote"] > 0
    dup = result["kv_bytes_per_token"]
    assert dup["per_rank_replicated"] == 4 * 40 * 4 + 2 * 16 * 4
    # rank 0 of ula-tp stores about half of the latent per token (address mod 2), the plain TP model all of it
    assert abs(dup["measured_ula_tp_latent_rank0"] / dup["latent"] - 0.5) < 0.02
    assert rows["ula-dp"]["stored_bytes_per_token"] == dup["latent"]
    assert (tmp_path / "bench_kv_capacity.png").exists()
