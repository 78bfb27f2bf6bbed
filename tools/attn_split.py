"""Flash-decoding (lowlat's attn_split) against the same kernel with each item's key parts folded on one thread, in
one process, rounds alternated: decode tok/s of one request at several context lengths, plain greedy decoding,
and whether the tokens are identical (they must be: the same part states folded in the same order).

Usage: python tools/attn_split.py [--model qwen2.5-coder-1.5b] (default: the bundled GGUF) [--contexts 1024,4096]
           [--threads 2] [--tokens 64] [--rounds 3]
Writes results/attn_split_<model>.json and .png; stop other jobs first (it is a benchmark)."""
import argparse
import os
import statistics

import torch
from tqdm import tqdm

from lanner import LLM, SamplingParams
from lanner.bench.report import markdown_table, pyplot, write_json

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default=None)
ap.add_argument("--contexts", default="1024,4096")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--dtype", default="auto")
args = ap.parse_args()
torch.set_num_threads(args.threads)
contexts = [int(c) for c in args.contexts.split(",")]
llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype, spec="none", plugin="lowlat",
          plugin_options={"lowlat": {"threads": args.threads}}, max_model_len=max(contexts) + 256)
kernel = llm.engine.plugins.plugins[0].kernel
kernel.profile = True
# real text, repeated to length: the source files of this package
text = "".join(open(os.path.join(r, f)).read() for r, _, fs in os.walk(os.path.dirname(__file__) + "/../lanner")
               for f in sorted(fs) if f.endswith(".py"))
ids = llm.tokenizer.encode(text)
params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
runs, table = [], []
for ctx in contexts:
    prompt = ids[:ctx]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the prompt's KV, cached from here on
    got = {True: [], False: []}
    tokens, attn_ms = {}, {True: [], False: []}
    for r in tqdm(range(args.rounds), desc=f"context {ctx}", leave=False):
        for split in (True, False) if r % 2 == 0 else (False, True):
            kernel.attn_split = split
            kernel.prof, kernel.prof_calls = [0.0] * 5, 0
            out = llm.generate([prompt], params)[0]
            got[split].append(out.metrics["decode_tok_s"])
            attn_ms[split].append(1000 * kernel.prof[1] / max(kernel.prof_calls, 1))
            tokens[split] = out.token_ids
    row = {"context": ctx, "split_tok_s": statistics.median(got[True]), "folded_tok_s": statistics.median(got[False]),
           "split_attention_ms": min(attn_ms[True]), "folded_attention_ms": min(attn_ms[False]),
           "identical": tokens[True] == tokens[False], "rounds": {"split": got[True], "folded": got[False]}}
    row["speedup"] = row["split_tok_s"] / row["folded_tok_s"]
    runs.append(row)
    table.append([ctx, f"{row['split_tok_s']:.1f}", f"{row['folded_tok_s']:.1f}", f"{row['speedup']:.2f}x",
                  f"{row['split_attention_ms']:.2f} / {row['folded_attention_ms']:.2f}", row["identical"]])
    print(markdown_table(["context", "split tok/s", "folded tok/s", "ratio", "attention ms/step (thread 0)",
                          "identical"], table[-1:]))
cfg = llm.engine.model_config
name = (args.model or "bundled").replace("/", "_")
result = {"model": args.model or "bundled", "geometry": {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                                            "head_dim": cfg.head_dim, "layers": cfg.num_layers},
          "threads": args.threads, "tokens": args.tokens, "dtype": str(llm.engine.config.torch_dtype), "runs": runs}
print(markdown_table(["context", "split tok/s", "folded tok/s", "ratio", "attention ms/step (thread 0)",
                      "identical"], table))
write_json(f"results/attn_split_{name}.json", result)
plt = pyplot()
fig, ax = plt.subplots(figsize=(6, 4))
xs = [r["context"] for r in runs]
ax.plot(xs, [r["split_tok_s"] for r in runs], "o-", label="split over the context (attn_split)")
ax.plot(xs, [r["folded_tok_s"] for r in runs], "s--", label="parts folded on one thread")
ax.set_xscale("log", base=2)
ax.set_xlabel("context (tokens)")
ax.set_ylabel("decode tok/s")
ax.set_title(f"{args.model or 'bundled SmolLM2-135M'}: lowlat flash-decoding, {args.threads} threads")
ax.legend()
fig.tight_layout()
fig.savefig(f"results/attn_split_{name}.png", dpi=120)
llm.close()
