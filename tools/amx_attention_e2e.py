"""lowlat's AMX attention in the engine: two engines on one model, amx_attention on and off, answer the same long
prompt (real source text: this venv's torch/nn/modules, files nobody on the project wrote) greedily, alternated.
Round 0 is a first answer (the suffix index has not seen it); later rounds repeat the question, so suffix drafts
run long (verify steps of up to spec_max_tokens rows). The prompt is prefilled once per engine beforehand (prefix
cache), so the times are decode. Reports output tok/s per round and whether the two engines' tokens agree (they
need not: the kernels' bits differ; each is lossless against its own plain decoding).

Usage: python tools/amx_attention_e2e.py [--model qwen2.5-coder-1.5b] [--contexts 4096,8192] [--spec suffix]
           [--rounds 3] [--tokens 128] [--threads 2]
Writes results/amx_attention_e2e.json and .png; stop other jobs first (it is a benchmark)."""
import argparse
import glob
import os
import sys
import time

from lanner import LLM, SamplingParams
from lanner.bench.report import bar_chart, markdown_table, write_json

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default="qwen2.5-coder-1.5b")
ap.add_argument("--contexts", default="4096,8192")
ap.add_argument("--spec", default="suffix")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
engines = {amx: LLM(model=args.model, spec=args.spec,
                    plugin_options={"lowlat": {"threads": args.threads, "amx_attention": amx}})
           for amx in (True, False)}
assert engines[True].engine.plugins.plugins[0].kernel.attn_amx, "this CPU / model does not run the AMX attention"
tok = engines[True].tokenizer
site = sorted(glob.glob(os.path.join(sys.prefix, "lib/python3*/site-packages/torch/nn/modules/*.py")))
ids = tok.encode("".join(open(p).read() for p in site))
result = {"model": args.model, "spec": args.spec, "threads": args.threads, "tokens": args.tokens, "runs": []}
table = []
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = tok.decode(ids[:ctx]) + "\n\n# Summarize the classes above in a comment:\n"
    for llm in engines.values():  # prefill once: the prefix cache holds it for every round
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for r in range(args.rounds):
        row = {"context": ctx, "round": r}
        outs = {}
        for amx, llm in engines.items():
            t = time.perf_counter()
            out = llm.generate(prompt, sp)[0]
            decode_s = time.perf_counter() - t - out.metrics["ttft_s"]
            name = "amx" if amx else "fma"
            row[f"{name}_tok_s"] = round(args.tokens / decode_s, 2)
            row[f"{name}_verify_steps"] = out.metrics["spec_verify_steps"]
            outs[amx] = out.token_ids
        row["speedup"] = round(row["amx_tok_s"] / row["fma_tok_s"], 2)
        row["same_tokens"] = outs[True] == outs[False]
        result["runs"].append(row)
        table.append([ctx, r, row["fma_tok_s"], row["amx_tok_s"], row["speedup"], row["same_tokens"]])
        print(row, flush=True)
print(markdown_table(["context", "round", "FMA tok/s", "AMX tok/s", "AMX / FMA", "same tokens"], table))
path = os.path.join(os.path.dirname(__file__), "..", "results", "amx_attention_e2e.json")
write_json(path, result)
bar_chart(path.replace(".json", ".png"), [f"{r['context']} r{r['round']}" for r in result["runs"]],
          [r["speedup"] for r in result["runs"]], f"{args.model}: AMX / FMA attention, output tok/s ({args.spec})",
          "speed-up")
print(f"wrote {path} and .png")
