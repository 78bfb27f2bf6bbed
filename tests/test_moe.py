"""MoE models (Qwen3-MoE, Mixtral) against transformers on tiny random checkpoints, FusedMoE against a per-expert
loop, tensor parallelism (2 processes) against TP=1, and the lowlat plugin taking MoE models."""
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models.loader import (
    ModelSource,
    _hf_weights,
    load_config,
    load_model,
    model_class,
)
from lanner.models.moe import FusedMoE
from lanner.plugins import Hardware, PluginMismatch, load_plugin

TOL = 1e-4
BASE = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "num_experts_per_tok": 2, "initializer_range": 0.05}
CONFIGS = {
    # layer 1 dense (mlp_only_layers), top-k renormalized; 37: uneven intermediate split under TP=2
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 8, "intermediate_size": 96, "moe_intermediate_size": 37,
        "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1}),
    # only every 2nd layer sparse (layer 1), top-k weights used as they come from the softmax
    "qwen3_moe_step2": ("qwen3_moe", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 2, "num_experts": 8, "intermediate_size": 96, "moe_intermediate_size": 24,
        "norm_topk_prob": False, "decoder_sparse_step": 2}),
    "mixtral": ("mixtral", "MixtralForCausalLM", {"num_hidden_layers": 2, "num_local_experts": 8,
                                                  "intermediate_size": 37}),
}


def make_hf(name, seed=0):
    model_type, arch, extra = CONFIGS[name]
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **BASE, **extra)
    cfg.architectures = [arch]
    # eager: the per-expert loop (the default grouped_mm needs 16-byte-aligned strides, 37 * 4 bytes is not)
    hf = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():  # non-trivial norms; routers spread enough that routing is not a coin toss
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif n.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, its saved folder, Lanner model loaded from the folder)."""
    hf = make_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    model, _ = load_model(ModelSource.resolve(str(folder)), torch.float32, "cpu")
    return hf, str(folder), model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def diff(a, b):
    return (a - b).abs().max().item()


def rand_ids(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_moe_layers_follow_the_config(pair):
    hf, _, model = pair
    for ours, theirs in zip(model.layers, hf.model.layers):
        sparse = hasattr(theirs.mlp, "experts")
        assert hasattr(ours.mlp, "experts") == sparse
    assert any(hasattr(layer.mlp, "experts") for layer in model.layers)


def test_prefill_then_16_greedy_decode_steps(pair):
    hf, _, model = pair
    runner = ModelRunner(model, 32, 4, torch.float32, "cpu")
    table = list(range(31, 0, -1))  # non-contiguous, descending blocks: the gather path
    ids = rand_ids(21, 1)
    ours = runner.run([SeqChunk(ids, 0, table, "all")])
    with torch.no_grad():
        r = hf(torch.tensor([ids]), use_cache=True)
    worst = diff(ours, r.logits[0])
    past, seq = r.cache, list(ids)
    for _ in range(16):
        tok = int(r.logits[0, -1].argmax())
        seq.append(tok)
        ours = runner.run([SeqChunk([tok], len(seq) - 1, table, "last")])
        with torch.no_grad():
            r = hf(torch.tensor([[tok]]), cache=past, use_cache=True)
        past = r.cache
        worst = max(worst, diff(ours[0], r.logits[0, -1]))
    assert worst <= TOL


def test_chunked_prefill(pair):
    hf, _, model = pair
    runner = ModelRunner(model, 8, 8, torch.float32, "cpu")
    ids = rand_ids(40, 2)
    table = [5, 2, 7, 0, 3]
    ours = torch.cat([runner.run([SeqChunk(ids[s : s + 7], s, table, "all")]) for s in range(0, len(ids), 7)])
    assert ours.shape[0] == len(ids)
    assert diff(ours, hf_logits(hf, ids)) <= TOL


def test_prefix_cache_hit(pair):
    hf, _, model = pair
    runner = ModelRunner(model, 16, 8, torch.float32, "cpu")
    a = rand_ids(27, 3)
    runner.run([SeqChunk(a, 0, [0, 1, 2, 3], "last")])
    # b shares a's first 3 full blocks (24 tokens) and computes only its own tail over them
    b = a[:24] + rand_ids(10, 4)
    ours = runner.run([SeqChunk(b[24:], 24, [0, 1, 2, 9, 10], "all")])
    assert diff(ours, hf_logits(hf, b)[24:]) <= TOL


def test_batch_of_sequences_of_different_lengths(pair):
    hf, _, model = pair
    runner = ModelRunner(model, 32, 4, torch.float32, "cpu")
    seqs = [rand_ids(n, 10 + n) for n in (5, 13, 9)]
    tables = [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 10]]
    ours = runner.run([SeqChunk(s, 0, t, "all") for s, t in zip(seqs, tables)])
    refs = [hf_logits(hf, s) for s in seqs]
    assert diff(ours, torch.cat(refs)) <= TOL
    # then one decode step for all three at their different positions
    nxt = [int(r[-1].argmax()) for r in refs]
    ours = runner.run([SeqChunk([t], len(s), tb, "last") for s, t, tb in zip(seqs, nxt, tables)])
    refs = torch.stack([hf_logits(hf, s + [t])[-1] for s, t in zip(seqs, nxt)])
    assert diff(ours, refs) <= TOL


def hf_greedy(hf, ids, n):
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = hf(x, cache=past, use_cache=True)
            past = r.cache
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_engine_greedy_matches_transformers(pair):
    hf, folder, _ = pair
    llm = LLM(model=folder, dtype="float32", skip_tokenizer=True, kv_cache_memory="0.01GiB", max_num_seqs=4,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    prompts = [rand_ids(18, 20), rand_ids(40, 21), rand_ids(18, 20)]  # the third hits the first's cached blocks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 16)


# ---------------------------------------------------------------- FusedMoE


def test_fused_moe_matches_per_expert_loop():
    torch.manual_seed(0)
    E, H, inter, T, k = 6, 24, 20, 11, 3
    gate, up, down = torch.randn(E, inter, H), torch.randn(E, inter, H), torch.randn(E, H, inter)
    moe = FusedMoE(E, H, inter)
    params = dict(moe.named_parameters())
    names = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    for e in range(E):
        for proj, w in names.items():
            leaf, piece = FusedMoE.checkpoint_piece(e, proj)
            assert leaf in params
            moe.load(leaf, w[e], piece)
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert E-1 never picked
    w = torch.rand(T, k)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            ref[t] += w[t, j] * (F.silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)) @ down[e].T
    out = moe(x, ids, w)
    assert diff(out, ref) <= 1e-4 * ref.abs().max().item()
    # Mixtral's w1/w3/w2 land in the same places as gate/up/down
    assert FusedMoE.checkpoint_piece(4, "w1") == FusedMoE.checkpoint_piece(4, "gate_proj")
    assert FusedMoE.checkpoint_piece(4, "w3") == FusedMoE.checkpoint_piece(4, "up_proj")
    assert FusedMoE.checkpoint_piece(4, "w2") == FusedMoE.checkpoint_piece(4, "down_proj")
    leaf, piece = FusedMoE.checkpoint_piece(0, "down_proj")
    with pytest.raises(ValueError, match="expected"):
        moe.load(leaf, torch.randn(H, inter + 1), piece)


def test_missing_expert_weight_is_reported(tmp_path):
    hf = make_hf("mixtral")
    hf.save_pretrained(tmp_path)
    cfg, ff, _ = load_config(ModelSource.resolve(str(tmp_path)))
    model = model_class(cfg)(cfg, ff)
    gone = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    weights = ((n, t) for n, t in _hf_weights(str(tmp_path)) if n != gone)
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.experts\.down\.weight"):
        model.load_weights(weights)


# ---------------------------------------------------------------- tensor parallelism


def tp_forward(model):
    """A batched prefill of two sequences, then a decode step for both: the logits of every row."""
    runner = ModelRunner(model, 16, 4, torch.float32, "cpu")
    a, b = rand_ids(13, 30), rand_ids(6, 31)
    first = runner.run([SeqChunk(a, 0, [0, 1, 2, 3], "all"), SeqChunk(b, 0, [5, 6], "all")])
    second = runner.run([SeqChunk([7], 13, [0, 1, 2, 3], "last"), SeqChunk([9], 6, [5, 6], "last")])
    return torch.cat([first, second])


def _tp_worker(rank, size, port, folder, out):
    from lanner.distributed import destroy_tp, init_tp

    torch.set_num_threads(1)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        model, _ = load_model(ModelSource.resolve(folder), torch.float32, "cpu")
        experts = next(layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts"))
        torch.save({"logits": tp_forward(model), "w13": tuple(experts.w13.shape), "w2": tuple(experts.w2.shape)},
                   f"{out}/rank{rank}.pt")
    finally:
        destroy_tp()


def test_tensor_parallel_2_matches_tp_1(tmp_path):
    hf = make_hf("qwen3_moe")
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(folder), str(tmp_path)), nprocs=2, join=True)
    model, _ = load_model(ModelSource.resolve(str(folder)), torch.float32, "cpu")
    ref = tp_forward(model)
    for rank, inter in ((0, 19), (1, 18)):  # 37 intermediate rows split unevenly
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["w13"] == (8, 2 * inter, 64) and got["w2"] == (8, 64, inter)
        assert diff(got["logits"], ref) <= TOL


# ---------------------------------------------------------------- plugins


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_lowlat_takes_moe_models(tmp_path, name):
    """lowlat runs MoE feed-forwards (tests/test_lowlat_moe.py); a malformed MoE config is refused by name."""
    make_hf(name).config.save_pretrained(tmp_path)
    cfg = load_config(ModelSource.resolve(str(tmp_path)))[0]
    plugin = load_plugin("lowlat")
    assert plugin.supports(cfg)
    bad = type(cfg)(**{**cfg.__dict__, "hf": {**cfg.hf, "num_experts_per_tok": 9}})  # 8 experts
    assert not plugin.supports(bad)
    with pytest.raises(PluginMismatch, match="top_k 9 of 8 experts"):
        plugin.check(bad, Hardware("cpu", torch.float32, "test cpu", None, frozenset({"avx512f"})))
