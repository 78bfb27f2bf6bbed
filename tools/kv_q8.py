"""The q8 KV cache against the model-dtype one (docs/quantized.md#kv-cache): error, memory and decode speed.

Per context length: real source text (this venv's site-packages, files nobody on the project wrote) is
prefilled into a bf16-cache engine and a q8-cache engine (and, for the error's scale, a float32 engine); the last
--eval tokens are then teacher-forced in 32-row lowlat steps, which read the cache through lowlat's attention.
Reported per engine pair: mean KL divergence of the next-token distributions, top-1 agreement and the mean |delta|
of the actual next token's log-probability. Then --decode plain decode steps at that context, alternated between
the bf16 and q8 engines, give the step time of each (median). KV bytes per token come from the engines' pools.

Usage: python tools/kv_q8.py [--model qwen2.5-coder-1.5b] [--contexts 2048,8192] [--eval 256] [--decode 24]
           [--threads 2] [--no-reference]
Writes results/kv_q8_<model>.json and .png; stop other jobs first (the decode timing is a benchmark)."""
import argparse
import glob
import os
import statistics
import sys
import time

import torch

from lanner import LLM
from lanner.bench.forward import block_table, divergence, teacher_forced_logprobs
from lanner.bench.report import environment, markdown_table, pyplot, write_json
from lanner.engine.runner import SeqChunk
from lanner.plugins import StepKind

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a model by name, a path, or 'default' (bundled)")
ap.add_argument("--contexts", default="2048,8192")
ap.add_argument("--eval", type=int, default=256)
ap.add_argument("--decode", type=int, default=24)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--no-reference", action="store_true", help="skip the float32 engine (the error's scale)")
args = ap.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]
longest = max(contexts) + args.decode + 1


def engine(dtype, kv):  # (the default KV budget, a quarter of the RAM, is mapped lazily: three engines fit)
    return LLM(model=None if args.model == "default" else args.model, dtype=dtype, kv_cache_dtype=kv, spec="none",
               enable_prefix_caching=False, plugin_options={"lowlat": {"threads": args.threads}})


engines = {"bf16": engine("bfloat16", "auto"), "q8": engine("bfloat16", "q8")}
if not args.no_reference:
    engines["f32"] = engine("float32", "auto")
tok = engines["bf16"].tokenizer
site = sorted(glob.glob(os.path.join(sys.prefix, "lib/python3*/site-packages/torch/nn/modules/*.py")))
text = "".join(open(p).read() for p in site)
ids_all = tok.encode(text)
assert len(ids_all) >= longest, f"{len(ids_all)} tokens of text, {longest} needed"
print(f"text: {len(site)} files of torch/nn/modules, {len(ids_all)} tokens", flush=True)


def decode_ms(llm, ids, reps):
    runner, bt = llm.engine.kv.runner, block_table(llm, len(ids) + args.decode + 1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.run([SeqChunk([ids[-1]], len(ids) + reps, bt, "last")], StepKind.DECODE, argmax=True)
    return (time.perf_counter() - t0) * 1e3


rows, result = [], {"model": args.model, "threads": args.threads, "eval_tokens": args.eval,
                    "environment": environment(engines["bf16"].engine.config), "contexts": []}
for ctx in contexts:
    ids = ids_all[:ctx]
    nxt = torch.tensor(ids_all[ctx - args.eval + 1 : ctx + 1])
    lp = {}
    for name, llm in engines.items():
        t = time.perf_counter()
        lp[name] = teacher_forced_logprobs(llm, ids, args.eval, room=args.decode + 1)
        print(f"{ctx} tokens: {name} prefilled and evaluated in {time.perf_counter() - t:.1f} s", flush=True)
    pairs = {"bf16_vs_q8": divergence(lp["bf16"], lp["q8"], nxt)}
    if "f32" in lp:
        pairs |= {"f32_vs_bf16": divergence(lp["f32"], lp["bf16"], nxt),
                  "f32_vs_q8": divergence(lp["f32"], lp["q8"], nxt)}
    times = {"bf16": [], "q8": []}
    for i in range(args.decode):  # alternated, one step each, at positions ctx .. ctx + decode - 1
        for name in times:
            times[name].append(decode_ms(engines[name], ids, i))
    entry = {"context": ctx, "errors": pairs,
             "decode_ms": {k: statistics.median(v) for k, v in times.items()},
             "kv_bytes_per_token": {k: engines[k].engine.kv.bytes_per_token for k in ("bf16", "q8")}}
    result["contexts"].append(entry)
    for pair, e in pairs.items():
        rows.append([ctx, pair, f"{e['kl_mean']:.5f}", f"{e['kl_max']:.4f}", f"{e['top1_agree']:.3f}",
                     f"{e['dlogprob_mean']:.4f}", f"{e['dlogprob_max']:.3f}"])
    d = entry["decode_ms"]
    print(f"{ctx} tokens: decode {d['bf16']:.1f} ms (bf16 KV) vs {d['q8']:.1f} ms (q8 KV): "
          f"{d['bf16'] / d['q8']:.2f}x; KV bytes/token {entry['kv_bytes_per_token']}", flush=True)

print(markdown_table(["context", "pair", "KL mean", "KL max", "top-1 agree", "|dlogp| mean", "|dlogp| max"], rows))
print(markdown_table(["context", "decode ms, bf16 KV", "decode ms, q8 KV", "speed-up", "KV bytes/token bf16 / q8"],
                     [[e["context"], f"{e['decode_ms']['bf16']:.1f}", f"{e['decode_ms']['q8']:.1f}",
                       f"{e['decode_ms']['bf16'] / e['decode_ms']['q8']:.2f}x",
                       f"{e['kv_bytes_per_token']['bf16']} / {e['kv_bytes_per_token']['q8']}"]
                      for e in result["contexts"]]))
name = args.model.replace("/", "_").replace(".gguf", "")
path = f"results/kv_q8_{name}.json"
write_json(path, result)
plt = pyplot()
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
xs = [e["context"] for e in result["contexts"]]
for pair in result["contexts"][0]["errors"]:
    a1.plot(xs, [e["errors"][pair]["kl_mean"] for e in result["contexts"]], marker="o", label=pair)
a1.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="mean KL (nats)", title="next-token KL")
a1.legend()
for k in ("bf16", "q8"):
    a2.plot(xs, [e["decode_ms"][k] for e in result["contexts"]], marker="o", label=f"{k} KV")
a2.set(xscale="log", xlabel="context (tokens)", ylabel="ms per decode step", title=f"{args.model}, "
       f"{args.threads} threads")
a2.legend()
fig.tight_layout()
fig.savefig(path.replace(".json", ".png"), dpi=110)
print("wrote", path)
