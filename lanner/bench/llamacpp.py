"""llama.cpp (llama-cpp-python) as a benchmark peer, run in its own process: two OpenMP runtimes in one process
slow each other (llama.cpp's and torch's), so a peer measured inside Lanner's process reads low.

`run_peer` starts `python -m lanner.bench.llamacpp` with the job as JSON on stdin; the child generates greedily
(top_k=1, no repeat penalty, EOS ignored: it stops at max_tokens) from the same prompt token ids and prints one
JSON line: per prompt the token ids, total and first-token seconds, and per generated token the gap between
llama.cpp's top two logits (to judge where another system's greedy tokens part from llama.cpp's). The gap
bookkeeping's own time is taken off the measured times.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

GGML_TYPE_F32 = 0  # ggml's type id (llama_cpp.GGML_TYPE_F32), without importing llama_cpp in Lanner's process

def available() -> str | None:
    """None when llama-cpp-python can be imported, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python not installed ({e}); `make peers` builds it"
    return None


def run_peer(model_path: str, prompt_ids: list[list[int]], warm_ids: list[int], max_tokens: int | list[int],
             threads: int, device: str = "cpu", timeout_s: float = 1800, f32_kv: bool = False,
             flash_attn: bool = False) -> list[dict]:
    """max_tokens: one for all prompts or one per prompt. llama-cpp-python keeps the KV of the longest prefix a
    prompt shares with the previous one (replayed sessions: the history), as Lanner's prefix cache does.
    f32_kv: a float32 KV cache instead of llama.cpp's default float16 (how far llama.cpp's own greedy tokens move
    with its KV precision). flash_attn: llama.cpp's flash attention (llama-cpp-python's default: off)."""
    job = {"model": model_path, "prompts": prompt_ids, "warm": warm_ids,
           "max_tokens": max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids),
           "threads": threads, "gpu": device.startswith("cuda"), "f32_kv": f32_kv, "flash_attn": flash_attn}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "lanner.bench.llamacpp"], input=json.dumps(job), env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama.cpp peer exited with {proc.returncode}: {' | '.join(tail)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["runs"]


def _main():
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    job = json.loads(sys.stdin.read())
    n_ctx = max(len(ids) + n for ids, n in zip(job["prompts"] + [job["warm"]], job["max_tokens"] + [16])) + 8
    llm = Llama(model_path=job["model"], n_ctx=n_ctx, n_threads=job["threads"], n_threads_batch=job["threads"],
                n_gpu_layers=-1 if job["gpu"] else 0, verbose=False, flash_attn=job.get("flash_attn", False),
                **({"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if job.get("f32_kv") else {}))
    n_vocab = llm.n_vocab()

    def generate(ids, n):
        tokens, gaps, ttft, spent = [], [], None, 0.0
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            t1 = time.perf_counter()
            if ttft is None:
                ttft = t1 - t0
            # the logits this token was picked from: the context's last row (scores are kept only with logits_all)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            top2 = np.partition(row, -2)[-2:]
            gaps.append(float(top2[1] - top2[0]))
            tokens.append(int(tok))
            spent += time.perf_counter() - t1
            if len(tokens) == n:
                break
        total = time.perf_counter() - t0 - spent
        return {"token_ids": tokens, "total_s": total, "ttft_s": ttft, "top2_gap": gaps}

    generate(job["warm"], 16)
    runs = [generate(ids, n) for ids, n in zip(job["prompts"], job["max_tokens"])]
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    _main()
