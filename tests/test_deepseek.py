"""DeepSeek-V3.2 and GLM-5 (MLA + DSA indexer + DeepSeek MoE) against transformers on tiny random checkpoints,
float32. Every sequence is longer than index_topk (16), so the indexer really drops tokens."""
import logging
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models import deepseek
from lanner.models.mla_rope import rope_frequencies, softmax_scale
from lanner.models.loader import ModelSource, load_model
from lanner.models.tiny import make_tiny_model

TOL = 1e-4
PATHS = ("absorbed", "expanded")
ARCHS = ("deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {arch: make_tiny_model(arch, str(tmp_path_factory.mktemp(arch))) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, folders):
    from transformers import (
        AutoModelForCausalLM,  # not at module level: the TP workers import this module
    )

    folder = folders[request.param]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, _ = load_model(ModelSource.resolve(folder), torch.float32, "cpu")
    return SimpleNamespace(arch=request.param, folder=folder, hf=hf, model=model)


def rand_ids(n, seed):
    return torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def diff(a, b):
    return (a - b).abs().max().item()


def runner(model, path, num_blocks=16, block_size=8):
    model.attn_path = path
    return ModelRunner(model, num_blocks, block_size, torch.float32, "cpu")


def test_cache_layout_follows_the_config(tiny):
    shapes = tiny.model.kv_cache_shapes()
    if tiny.arch == "deepseek_v32":
        assert shapes == [((40,), (16,))] * 3  # latent (32 + 8 rope) and index key on every layer
    else:  # shared-indexer layers keep no index keys
        assert shapes == [((40,), (16,)), ((40,),), ((40,), (16,)), ((40,),)]
    assert [hasattr(layer.mlp, "experts") for layer in tiny.model.layers] == [False] + [True] * (len(shapes) - 1)


def test_yarn_rope_matches_transformers():
    """DeepSeek-V3.2's own YaRN settings (factor 40 over 4096), in the new and the old config layout."""
    from transformers import DeepseekV32Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    cfg = DeepseekV32Config(rope_parameters=dict(rope), max_position_embeddings=163840)
    inv_freq, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    old = {k: v for k, v in cfg.to_dict().items() if k != "rope_parameters"}
    old |= {"rope_theta": 10000.0, "rope_scaling": {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
            | {"type": "yarn"}}
    for hf in (cfg.to_dict(), old):
        ours, factor = rope_frequencies(hf, 64)
        assert torch.allclose(ours.float(), inv_freq, rtol=1e-6, atol=0) and factor == pytest.approx(attn_factor)
        assert softmax_scale(hf) == pytest.approx(yarn_apply_mscale(rope, 192 ** -0.5))
    assert softmax_scale(cfg.to_dict()) > 192 ** -0.5  # the mscale correction is in effect


def test_prefill_then_16_greedy_decode_steps_both_paths(tiny):
    prompt = rand_ids(40, 1)
    got = {}
    for path in PATHS:
        r = runner(tiny.model, path)
        rows, seq = [r.run([SeqChunk(prompt, 0, list(range(16)), "all")])], list(prompt)
        for _ in range(16):
            seq.append(int(rows[-1][-1].argmax()))
            rows.append(r.run([SeqChunk([seq[-1]], len(seq) - 1, list(range(16)), "all")]))
        got[path] = (torch.cat(rows), seq + [int(rows[-1][-1].argmax())])
    ref = hf_logits(tiny.hf, got["absorbed"][1][:-1])  # [56, vocab]: every step's logits, by causality
    for path in PATHS:
        logits, seq = got[path]
        assert diff(logits, ref) <= TOL, path
        assert ref[39:].argmax(-1).tolist() == seq[40:], path  # HF's greedy choice at every step
    assert diff(got["absorbed"][0], got["expanded"][0]) <= TOL


def test_sparse_selection_changes_the_output(tiny):
    """The same weights attending to every token give other logits: the parity above depends on the selection."""
    ids = rand_ids(48, 2)
    dense = [layer.self_attn.indexer for layer in tiny.model.layers if layer.self_attn.indexer is not None]
    try:
        for ix in dense:
            ix.topk = 10**6
        logits = runner(tiny.model, "absorbed").run([SeqChunk(ids, 0, list(range(16)), "all")])
    finally:
        for ix in dense:
            ix.topk = 16
    ref = hf_logits(tiny.hf, ids)
    assert diff(logits[:16], ref[:16]) <= TOL  # up to topk tokens of context nothing is dropped
    assert diff(logits[24:], ref[24:]) > 1e-2


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prefill(tiny, path):
    ids = rand_ids(47, 3)
    r = runner(tiny.model, path)
    rows = [r.run([SeqChunk(ids[s : s + 7], s, list(range(16)), "all")]) for s in range(0, len(ids), 7)]
    assert diff(torch.cat(rows), hf_logits(tiny.hf, ids)) <= TOL


@pytest.mark.parametrize("path", PATHS)
def test_prefix_cache_hit(tiny, path):
    """A second sequence reuses the first's 4 full blocks (32 tokens) and computes only its own tail."""
    a = rand_ids(40, 4)
    b = a[:32] + rand_ids(13, 5)
    r = runner(tiny.model, path)
    r.run([SeqChunk(a, 0, [0, 1, 2, 3, 4], "none")])
    logits = r.run([SeqChunk(b[32:], 32, [0, 1, 2, 3, 9, 7], "all")])
    assert diff(logits, hf_logits(tiny.hf, b)[32:]) <= TOL


@pytest.mark.parametrize("path", PATHS)
def test_batch_of_sequences_of_different_lengths(tiny, path, monkeypatch):
    """One step mixes a fresh prefill, a decode row and a continued chunk over scattered blocks. Indexer scores
    and absorbed rows are computed in small blocks here, as on long contexts."""
    monkeypatch.setattr(deepseek, "INDEX_SCORE_ELEMS", 4000)
    monkeypatch.setattr(deepseek, "ABSORB_ROWS", 5)
    s1, s2, s3 = rand_ids(30, 6), rand_ids(26, 7), rand_ids(20, 8)
    t1, t2, t3 = [0, 1, 2, 3], [8, 5, 6, 4], [10, 12, 11]
    r = runner(tiny.model, path)
    first = r.run([SeqChunk(s2[:25], 0, t2, "all"), SeqChunk(s3[:13], 0, t3, "all")])
    second = r.run([SeqChunk(s1, 0, t1, "all"), SeqChunk(s2[25:], 25, t2, "all"), SeqChunk(s3[13:], 13, t3, "all")])
    r2, r3 = hf_logits(tiny.hf, s2), hf_logits(tiny.hf, s3)
    assert diff(first, torch.cat([r2[:25], r3[:13]])) <= TOL
    assert diff(second, torch.cat([hf_logits(tiny.hf, s1), r2[25:], r3[13:]])) <= TOL


def hf_greedy(hf, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[-n:]


def test_engine_greedy_matches_transformers(tiny):
    tiny.model.attn_path = "auto"
    llm = LLM(model=tiny.folder, dtype="float32", skip_tokenizer=True, block_size=8, kv_cache_memory="0.01GiB",
              max_num_batched_tokens=24)  # prompts are prefilled in chunks
    base = rand_ids(37, 9)
    prompts = [base, rand_ids(22, 10), rand_ids(45, 11)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hit = base[:32] + rand_ids(6, 12)  # reuses the first prompt's 4 full blocks
    again = llm.generate([hit], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert again.metrics["cached_prompt_tokens"] == 32
    for p, out in zip(prompts + [hit], outs + [again]):
        assert out.token_ids == hf_greedy(tiny.hf, p, 12)


def tp_forward(model):
    """Prefill of two sequences (expanded path), then two decode steps (absorbed): every row's logits."""
    model.attn_path = "expanded"
    r = ModelRunner(model, 16, 8, torch.float32, "cpu")
    a, b = rand_ids(30, 13), rand_ids(21, 14)
    rows = [r.run([SeqChunk(a, 0, [0, 1, 2, 3], "all"), SeqChunk(b, 0, [5, 6, 7], "all")])]
    model.attn_path = "absorbed"
    for i in range(2):
        rows.append(r.run([SeqChunk([7 + i], 30 + i, [0, 1, 2, 3], "last"), SeqChunk([9 + i], 21 + i, [5, 6, 7], "last")]))
    return torch.cat(rows)


def _tp_worker(rank, size, port, folders, out):
    from lanner.distributed import destroy_tp, init_tp

    torch.set_num_threads(1)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        for arch, folder in folders.items():
            model, _ = load_model(ModelSource.resolve(folder), torch.float32, "cpu")
            attn = model.layers[0].self_attn
            torch.save({"logits": tp_forward(model), "heads": attn.num_heads,
                        "kv_b": tuple(attn.kv_b_proj.weight.shape)}, f"{out}/{arch}-rank{rank}.pt")
    finally:
        destroy_tp()


def test_tensor_parallel_2_matches_tp_1(folders, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, folders, str(tmp_path)), nprocs=2, join=True)
    for arch, folder in folders.items():
        ref = tp_forward(load_model(ModelSource.resolve(folder), torch.float32, "cpu")[0])
        for rank in range(2):
            got = torch.load(tmp_path / f"{arch}-rank{rank}.pt")
            assert got["heads"] == 2 and got["kv_b"] == (2 * (16 + 24), 32), arch  # 2 of 4 heads per rank
            assert diff(got["logits"], ref) <= TOL, arch


def test_mtp_layers_are_skipped_with_a_log_line(tiny, tmp_path, caplog):
    """A checkpoint with a next-token-prediction layer after the decoder layers loads and gives the same logits."""
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{tiny.folder}/model.safetensors")
    n = len(tiny.model.layers)
    mtp = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone() for k, v in weights.items()
           if k.startswith("model.layers.1.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file(weights | mtp, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{tiny.folder}/config.json", tmp_path)
    with caplog.at_level(logging.INFO, logger="lanner"):
        model, _ = load_model(ModelSource.resolve(str(tmp_path)), torch.float32, "cpu")
    assert f"skipped {len(mtp)} MTP" in caplog.text
    ids = rand_ids(20, 15)
    assert diff(runner(model, "auto").run([SeqChunk(ids, 0, [0, 1, 2], "all")]), hf_logits(tiny.hf, ids)) <= TOL
