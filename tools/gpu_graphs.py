"""One-shot GPU check of the cudagraph plugin (docs/gpu.md, "CUDA graphs"), random weights (the bundled GGUF does not
travel). Run from the repository root: `python3 tools/gpu_graphs.py` (writes $OUT/gpu_graphs.json and
$OUT/profile_step.json, default OUT=/tmp); `--smoke` runs the same sections on the CPU with a tiny geometry (the
compiled step without graphs) to show the script itself works.

1. parity, float32, 135M geometry: greedy tokens of LLM(plugin="cudagraph") equal LLM(plugin=None)'s and
   transformers' generate (3 prompts, batch 3 padded to 4, n-gram verify steps where they occur); every plugin
   step is also checked against the engine's forward (plugin_verify, relative 1e-4);
2. speed, bfloat16, 135M and 1B geometries: per-step latency through the engine's ModelRunner (decode at batch 1, 4,
   16 and a k=4 verify at batch 1, context ~300) with graphs and with the eager forward, the graph's replay alone,
   the first step's logits difference and argmax agreement, then LLM.generate decode tok/s at batch 1, 4, 16 (256
   prompt tokens, 128 new) with and without the plugin and whether their greedy tokens agree;
3. profile: torch.profiler over one batch-1 decode step through the graph (chrome trace + top kernels).
Every section is timed and written to the JSON as it finishes; a failing section records its error."""
import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())
from lanner import LLM, SamplingParams  # noqa: E402
from lanner.engine.runner import ModelRunner, SeqChunk  # noqa: E402
from lanner.plugins import PluginRuntime, StepKind, register_plugin  # noqa: E402
from lanner.plugins.cudagraph import CudaGraphPlugin  # noqa: E402
from lanner.plugins.cudagraph.step import static_step  # noqa: E402

# the device machine runs the checkout without installing it: no entry points there
register_plugin("cudagraph", CudaGraphPlugin)
GEOMETRIES = {  # SmolLM2-135M, Llama-3.2-1B, and a tiny one for --smoke
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0),
}
CASES = [("decode", 1, 1), ("decode", 4, 1), ("decode", 16, 1), ("verify", 1, 5)]  # (kind, batch, rows)
# the buckets the speed runs need: 3 compile classes (batch 1, batch n, batch 1 x 5 rows)
SPEED = {"batch_sizes": [1, 4, 16], "rows": [1, 5], "max_rows": 16, "contexts": [512]}

args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
args.add_argument("--smoke", action="store_true", help="CPU, tiny geometry, fewer steps: checks the script runs")
args.add_argument("--sections", default="parity,speed135m,speed1b,profile", help="comma-separated subset")
args.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                  help="a cudagraph plugin option for every section, e.g. dynamic=false or graphs=false")
args = args.parse_args()
DEV = "cpu" if args.smoke else "cuda"
BASE = {"cpu": True} if args.smoke else {}
BASE |= {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.option)}
N_STEPS, N_NEW, PROMPT = (4, 12, 64) if args.smoke else (50, 128, 256)
OUT = os.environ.get("OUT", "/tmp")
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
       "smoke": args.smoke, "sections_s": {}}
print(res, flush=True)


def save():
    with open(os.path.join(OUT, "gpu_graphs.json"), "w") as f:
        json.dump(res, f, indent=1)


def section(name, fn):
    t0 = time.time()
    try:
        res[name] = fn()
    except Exception as e:
        res[name] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
    res["sections_s"][name] = round(time.time() - t0, 1)
    print(f"[{name}] {time.time() - t0:.1f}s", json.dumps(res.get(name))[:3000], flush=True)
    save()


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def make_model(geometry: str, dtype) -> str:
    """A random Llama checkpoint with unit-scale weights (fan-in scaled projections, N(0, 1) tied embedding): logits
    far apart, so greedy tokens do not hinge on rounding as they would at transformers' 0.02 init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = f"/tmp/gpu_graphs_{geometry}_{str(dtype).split('.')[-1]}"
    if os.path.isfile(os.path.join(folder, "config.json")):  # made by an earlier section
        return folder
    cfg = LlamaConfig(**GEOMETRIES[geometry], max_position_embeddings=8192, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_()
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.to(dtype).save_pretrained(folder)
    del model
    return folder


def engine(folder, dtype, plugin=None, options=None, **kw):
    opts = {"cudagraph": {**BASE, **(options or {})}} if plugin else None
    # 16 prompts of 256 tokens prefill in one step: every request of a batch decodes over the same steps
    return LLM(model=folder, dtype=dtype, device=DEV, skip_tokenizer=True, kv_cache_memory="4GiB", max_num_seqs=16,
               max_num_batched_tokens=4096, spec=kw.pop("spec", "none"), plugin=plugin, plugin_options=opts, **kw)


def prompts(n, length, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def tokens(llm, ps, n_new):
    return [o.token_ids for o in llm.generate(ps, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))]


def parity():
    from transformers import AutoModelForCausalLM

    geometry = "tiny" if args.smoke else "135m"
    folder = make_model(geometry, torch.float32)
    vocab = GEOMETRIES[geometry]["vocab_size"]
    ps = [p[:20] * 3 for p in prompts(3, 20, vocab)]  # repeated text: n-gram drafts, so some verify steps
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(DEV).eval()
    with torch.no_grad():
        want_hf = [hf.generate(torch.tensor([p], device=DEV), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in ps]
    del hf
    with engine(folder, "float32", spec="ngram") as llm:
        eager = tokens(llm, ps, 32)
    with engine(folder, "float32", "cudagraph", {"batch_sizes": [4], "rows": [1, 8], "contexts": [256]},
                spec="ngram", plugin_verify=1000) as llm:
        got = tokens(llm, ps, 32)
        rt = llm.engine.plugins
        counts = {f"{p}/{k}": n for (p, k), n in rt.counts.items()}
    return {"identical_to_eager": got == eager, "identical_to_transformers": got == want_hf,
                          "eager_identical_to_transformers": eager == want_hf, "plugin_disabled": rt.disabled,
                          "steps": counts}


def step_times(model, plugin, vocab):
    """ModelRunner steps at context ~300, graphs vs the eager forward, same prefilled ids: ms per step (host
    overhead and the read of the argmax included, as in the engine), first-step logits, replay-only time."""
    ctx, per_seq = 300, (300 + N_STEPS + 16) // 16 + 2
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(16)]
    ids = prompts(16, ctx, vocab, seed=2)
    dtype = next(model.parameters()).dtype
    out, first, runtimes = {}, {}, {"graphs": PluginRuntime([plugin]), "eager": None}
    for name, runtime in runtimes.items():
        runner = ModelRunner(model, 16 * per_seq, 16, dtype, DEV, (), runtime)
        runner.run([SeqChunk(ids[s], 0, tables[s], "none") for s in range(16)], StepKind.PREFILL)
        for kind, b, q in CASES:
            key = f"{kind}_b{b}" + (f"_k{q - 1}" if q > 1 else "")
            step_kind = StepKind.VERIFY if kind == "verify" else StepKind.DECODE

            def chunks(i):
                return [SeqChunk(ids[s][1 : 1 + q], ctx + i, tables[s], "all" if q > 1 else "last") for s in range(b)]

            first[(name, key)] = runner.run(chunks(0), step_kind).float().cpu()
            for i in range(3):  # warm: the first use of a bucket captures its graph
                runner.run(chunks(i), step_kind, argmax=True).tolist()
            sync()
            t0 = time.perf_counter()
            for i in range(N_STEPS):
                runner.run(chunks(i), step_kind, argmax=True).tolist()
            sync()
            out.setdefault(key, {})[f"{name}_ms"] = 1e3 * (time.perf_counter() - t0) / N_STEPS
        if name == "graphs" and DEV == "cuda":  # the batch-1 graph alone, while the cache it was captured on lives
            runner.run([SeqChunk(ids[0][:1], ctx, tables[0])], StepKind.DECODE, argmax=True).tolist()  # its inputs
            graph = next(k.graphs[()][0] for k in plugin.buckets.values() if (k.Bp, k.Qp) == (1, 1) and k.graphs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                graph.replay()
            end.record()
            sync()
            out["decode_b1_replay_only_ms"] = start.elapsed_time(end) / 100
        del runner
    for key, row in out.items():
        a, b = first[("graphs", key)], first[("eager", key)]
        row["graphs_tok_s"] = int(key.split("_b")[1].split("_")[0]) * 1e3 / row["graphs_ms"]
        row["speedup"] = row["eager_ms"] / row["graphs_ms"]
        row["logits_rel_diff"] = ((a - b).abs().max() / b.abs().max()).item()
        row["argmax_agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    out["graphs_disabled"] = runtimes["graphs"].disabled  # a plugin failure: its steps ran the eager forward
    out["verify_k4_over_decode_b1"] = out["verify_b1_k4"]["graphs_ms"] / out["decode_b1"]["graphs_ms"]
    return out


def speed(geometry):
    g = "tiny" if args.smoke else geometry
    folder = make_model(g, torch.bfloat16)
    vocab = GEOMETRIES[g]["vocab_size"]
    row = {}
    t0 = time.time()
    with engine(folder, "bfloat16", "cudagraph", SPEED) as llm:
        row["engine_build_s"] = time.time() - t0  # weights, the compiles (at build on CUDA), the KV cache
        row["plugin_bytes"] = llm.engine.plugin_bytes
        # compiled classes of the step so far, all sections (on CUDA: parity 2, then 3 per speed geometry)
        entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)  # a debug API
        row["compiled_graphs_total"] = len(entries(static_step.__code__)) if entries else None
        plugin = llm.engine.plugins.plugins[0]
        row["steps"] = step_times(llm.engine.model, plugin, vocab)
        graphed = generate_speed(llm, vocab)
        row["plugin_disabled"] = llm.engine.plugins.disabled
        row["eager_steps_in_generate"] = plugin.eager_steps
    with engine(folder, "bfloat16") as llm:
        eager = generate_speed(llm, vocab)
    for b in graphed:
        row[f"generate_b{b}"] = {
            "graphs_decode_tok_s": graphed[b][0], "eager_decode_tok_s": eager[b][0],
            "speedup": graphed[b][0] / eager[b][0],
            "greedy_identical": graphed[b][1] == eager[b][1],
            "first_divergence": [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None)
                                 for u, v in zip(graphed[b][1], eager[b][1])]}
    return row


def generate_speed(llm, vocab):
    """batch -> (decode tok/s summed over the batch's requests, greedy tokens): decode time only (from each
    request's first token to its last), after a warm-up run."""
    out = {}
    for b in (1, 4, 16):
        ps = prompts(b, PROMPT, vocab, seed=3 + b)
        tokens(llm, ps, 8)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))
        out[b] = (sum(o.metrics["decode_tok_s"] for o in outs), [o.token_ids for o in outs])
    return out


def profile():
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    g = "tiny" if args.smoke else "135m"
    folder = make_model(g, torch.bfloat16)
    with engine(folder, "bfloat16", "cudagraph", {"batch_sizes": [1], "rows": [1], "contexts": [512]}) as llm:
        model, plugin = llm.engine.model, llm.engine.plugins.plugins[0]
        runner = ModelRunner(model, 32, 16, torch.bfloat16, DEV, (), PluginRuntime([plugin]))
        ids = prompts(1, 300, GEOMETRIES[g]["vocab_size"], seed=4)[0]
        table = list(range(32))
        runner.run([SeqChunk(ids, 0, table, "none")], StepKind.PREFILL)
        for i in range(3):
            runner.run([SeqChunk([ids[i]], 300 + i, table)], StepKind.DECODE, argmax=True).tolist()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            runner.run([SeqChunk([ids[3]], 303, table)], StepKind.DECODE, argmax=True).tolist()
            sync()
        prof.export_chrome_trace(os.path.join(OUT, "profile_step.json"))
        sort = "cuda_time_total" if DEV == "cuda" else "cpu_time_total"
        return {"table": prof.key_averages().table(sort_by=sort, row_limit=20,
                                                                       max_name_column_width=70).splitlines()}


wanted = args.sections.split(",")
for name, fn in (("parity", parity), ("speed135m", lambda: speed("135m")), ("speed1b", lambda: speed("1b")),
                 ("profile", profile)):
    if name in wanted:
        section(name, fn)
print(json.dumps(res, indent=1)[:20000])
