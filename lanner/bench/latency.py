"""Single-stream latency: Lanner vs Hugging Face transformers `generate()` vs llama.cpp, greedy, fixed length.

Every system gets the same chat-templated prompt token ids and generates exactly --max-tokens tokens with
EOS ignored, so the runs do equal work. tok/s = output tokens / total time including prefill.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from statistics import median

from lanner.bench import report

HELP = "Single-stream latency vs Hugging Face transformers and llama.cpp."
DESCRIPTION = (
    "Single-stream latency, greedy, fixed output length: Lanner vs Hugging Face transformers generate() on the "
    "same weights and dtype, and llama.cpp (llama-cpp-python) on the same GGUF when it is installed. Also checks "
    "that Lanner's greedy token ids equal transformers'.")

PROMPTS = [
    "Write a short poem about the sea at night.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Explain how a refrigerator keeps food cold.",
    "List ten tips for staying productive when working from home.",
]
WARMUP_PROMPT = "Say hello in three languages."  # not a measured prompt: it would seed the prefix cache
WARMUP_TOKENS = 16


def add_arguments(p):
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                   metavar=f"{{1..{len(PROMPTS)}}}", help="how many of the fixed prompts to run")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers (and the token-id check)")
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/bench_latency.json); "
                                               "the PNG chart is written next to it")
    p.add_argument("--out-dir", default="results", help="folder for the result files when --json is not given")


def summary(runs: list[dict]) -> dict:
    """A system's row from its run records (run_record): medians over the prompts, and the records."""
    # the median over prompts: one prompt stalled by other work on a shared machine should not move the result
    def mid(key):
        vals = [r[key] for r in runs if r[key] is not None]
        return median(vals) if vals else None

    return {"tok_s": mid("tok_s"), "ttft_s": mid("ttft_s"), "decode_tok_s": mid("decode_tok_s"),
            "tau": mid("tau") if any("tau" in r for r in runs) else None,
            "per_prompt": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}


def run_record(token_ids, total_s, ttft_s) -> dict:
    """One prompt's generation: tokens, wall time, time to first token, and the speeds they give."""
    n = len(token_ids)
    decode_s = total_s - ttft_s if ttft_s is not None else None
    return {"output_tokens": n, "total_s": total_s, "tok_s": n / total_s, "ttft_s": ttft_s,
            "decode_tok_s": (n - 1) / decode_s if decode_s and n > 1 else None, "token_ids": token_ids}


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A user message in the model's chat template, or the bare text for a base model without one."""
    if not tokenizer.hf.chat_template:
        return tokenizer.encode(text)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def bench_lanner(llm, prompt_ids: list[list[int]], max_tokens: int) -> list[dict]:
    from lanner.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warm = encode_prompt(llm.tokenizer, WARMUP_PROMPT)
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    runs = []
    for ids in prompt_ids:
        t0 = time.perf_counter()
        out = llm.generate(ids, params)[0]
        total = time.perf_counter() - t0
        runs.append(run_record(out.token_ids, total, out.metrics["ttft_s"]) |
                    {"text": out.text, "tau": out.metrics["spec_accept_length"]})
    return runs


def bench_hf(source, dtype: str, device: str, prompt_ids, warm_ids, max_tokens: int, pad_id: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from lanner.config import DTYPES

    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), dtype=DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=DTYPES[dtype])
    model.to(device).eval()

    def generate(ids, n):
        # eos_token_id=[] rather than min_new_tokens: min_new_tokens masks EOS out of the logits, which changes
        # the greedy choice; an empty EOS list keeps EOS selectable and just does not stop on it, exactly like
        # Lanner's ignore_eos
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=pad_id)
        x = torch.tensor([ids], device=device)
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
        tokens = out[0, len(ids):].tolist()  # .tolist() waits for the device
        return tokens, time.perf_counter() - t0

    generate(warm_ids, WARMUP_TOKENS)
    runs = []
    for ids in prompt_ids:
        _, ttft = generate(ids, 1)  # generate() has no first-token hook: time a one-token run
        tokens, total = generate(ids, max_tokens)
        runs.append(run_record(tokens, total, ttft))
    return runs


def bench_llama_cpp(source, device: str, prompt_ids, warm_ids, max_tokens: int, threads: int) -> list[dict]:
    """llama.cpp in its own process (lanner.bench.llamacpp), with Lanner's thread count."""
    from lanner.bench.llamacpp import run_peer

    return [run_record(r["token_ids"], r["total_s"], r["ttft_s"])
            for r in run_peer(source.path, prompt_ids, warm_ids, max_tokens, threads, device)]


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _skip(reason: str) -> dict:
    print(f"\n*** llama.cpp SKIPPED: {reason} ***\n", file=sys.stderr, flush=True)
    return {"skipped": reason}


def run(args, engine_options: dict) -> dict:
    import torch

    from lanner.llm import LLM

    if args.tp and len(args.tp) > 1:
        return run_tp_sweep(args, engine_options, args.tp)
    json_path, png_path = report.output_paths(args.json, args.out_dir, "bench_latency")
    llm = LLM(**engine_options)
    config, source = llm.engine.config, llm.engine.source
    prompts = PROMPTS[: args.prompts]
    prompt_ids = [encode_prompt(llm.tokenizer, p) for p in prompts]
    warm_ids = encode_prompt(llm.tokenizer, WARMUP_PROMPT)
    pad_id = llm.tokenizer.hf.pad_token_id
    pad_id = pad_id if pad_id is not None else llm.tokenizer.eos_token_ids[0]
    print(f"latency: {source.name} ({config.dtype}, {config.device}), {len(prompts)} prompts x {args.max_tokens} "
          "tokens", file=sys.stderr, flush=True)

    # the configured system first, then the peers measured in the same run: without speculation (when it has
    # a plugin and speculation) and plain Lanner (no speculation, no plugin)
    plugin = config.plugin if config.plugin not in (None, "", "none") else None
    variants = []
    if config.spec or plugin:
        variants.append(("lanner" + (f"+{plugin}" if plugin else "") + (f"+{config.spec}" if config.spec else ""),
                         {}))
        if config.spec and plugin:
            variants.append((f"lanner+{plugin}", {"spec": None, "draft": None}))
    variants.append(("lanner", {"spec": None, "draft": None, "plugin": None}))
    runs = {}
    for i, (name, overrides) in enumerate(variants):
        if i:
            llm.close()  # tensor-parallel workers: one group per process
            del llm
            gc.collect()
            llm = LLM(**{**engine_options, **overrides})
        runs[name] = bench_lanner(llm, prompt_ids, args.max_tokens)
    llm.close()
    del llm  # on CUDA the engine's KV cache holds most of the free memory: release it before loading HF
    gc.collect()
    if config.device.startswith("cuda"):
        torch.cuda.empty_cache()

    systems = {name: summary(r) for name, r in runs.items()}
    for name, _ in variants[:-1]:
        systems[name]["speedup_vs_plain"] = systems[name]["tok_s"] / systems["lanner"]["tok_s"]
        systems[name]["greedy_identical_to_plain"] = all(
            a["token_ids"] == b["token_ids"] for a, b in zip(runs[name], runs["lanner"]))
    if args.no_hf:
        systems["hf"] = {"skipped": "--no-hf"}
    else:
        runs["hf"] = bench_hf(source, config.dtype, config.device, prompt_ids, warm_ids, args.max_tokens, pad_id)
        systems["hf"] = summary(runs["hf"])

    from lanner.bench.llamacpp import available

    if available():
        systems["llama.cpp"] = _skip(available())
    else:
        if source.kind != "gguf":
            systems["llama.cpp"] = _skip("the model is not a GGUF file")
        else:
            try:
                threads = ((config.plugin_options or {}).get("lowlat", {}).get("threads") or torch.get_num_threads())
                runs["llama.cpp"] = bench_llama_cpp(source, config.device, prompt_ids, warm_ids, args.max_tokens,
                                                    threads)
                systems["llama.cpp"] = summary(runs["llama.cpp"]) | {
                    "threads": threads, "note": "llama.cpp computes on the GGUF's quantized weights, in its own "
                    "process"}
            except Exception as e:  # a broken llama.cpp build must not lose the other systems' results
                systems["llama.cpp"] = _skip(f"llama.cpp failed: {type(e).__name__}: {e}")

    greedy_match = None
    if "hf" in runs:
        greedy_match = [{"prompt": i, "matched_prefix": matched_prefix(a["token_ids"], b["token_ids"]),
                         "tokens": len(a["token_ids"]), "identical": a["token_ids"] == b["token_ids"]}
                        for i, (a, b) in enumerate(zip(runs["lanner"], runs["hf"]))]

    result = {"benchmark": "latency", "model": source.name, "model_path": source.path, "model_kind": source.kind,
              "spec": config.spec, "draft": config.draft, "plugin": plugin, "spec_tokens": config.spec_tokens if config.spec else None,
              "max_tokens": args.max_tokens, "prompts": prompts, "env": report.environment(config),
              "systems": systems, "greedy_match_vs_hf": greedy_match}
    report.write_json(json_path, result)
    measured = {name: s for name, s in systems.items() if "skipped" not in s}
    report.bar_chart(png_path, list(measured), [s["tok_s"] for s in measured.values()],
                     f"Single-stream latency: {source.name}, {config.dtype}, {config.device}",
                     f"output tok/s (incl. prefill, {args.max_tokens} tokens)")
    print(format_table(result))
    print(f"\nwrote {json_path} and {png_path}")
    return result


def format_table(result: dict) -> str:
    systems = result["systems"]
    hf = systems["hf"].get("tok_s")
    plain = systems["lanner"]["tok_s"]
    rows = []
    for name, s in systems.items():
        if "skipped" in s:
            rows.append([name, "skipped", "", "", "", "", s["skipped"]])
            continue
        ratio = f"{s['tok_s'] / hf:.2f}x" if hf else "n/a"
        rows.append([name, report.fmt(s["tok_s"]), report.fmt(s["ttft_s"] and s["ttft_s"] * 1000),
                     report.fmt(s["decode_tok_s"]), report.fmt(s.get("tau")), f"{s['tok_s'] / plain:.2f}x", ratio])
    text = report.markdown_table(["system", "tok/s", "TTFT ms", "decode-only tok/s", "tau", "vs lanner plain",
                                  "vs HF"], rows)
    for name, s in systems.items():
        if "greedy_identical_to_plain" in s:
            text += f"\n\n{name} greedy output identical to plain decoding: {s['greedy_identical_to_plain']}"
    text += "\n\n(medians over prompts; tok/s = output tokens / total time including prefill)"
    if result["greedy_match_vs_hf"]:
        text += "\n\nLanner vs HF greedy token ids: " + ", ".join(
            f"prompt {m['prompt'] + 1}: " + ("identical" if m["identical"] else
                                             f"first {m['matched_prefix']}/{m['tokens']} match")
            for m in result["greedy_match_vs_hf"])
    return text


# ------------------------------------------------------------------ --tp 1,2: tensor-parallel sizes compared

def run_tp_sweep(args, engine_options: dict, sizes: list[int]) -> dict:
    """Lanner at each tensor-parallel size, one after another in this process (each size starts its own workers).
    The sizes share the same cores: with T torch threads, each of the N ranks computes with max(1, T // N)."""
    import torch

    from lanner.llm import LLM

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("lanner: error: bench latency --tp A,B starts its own workers for each size; run it without torchrun")
    json_path, png_path = report.output_paths(args.json, args.out_dir, "bench_latency_tp")
    threads = torch.get_num_threads()
    runs, systems, config = {}, {}, None
    for n in sizes:
        name = f"lanner tp={n}"
        torch.set_num_threads(max(1, threads // n))  # workers take rank 0's count
        try:
            with LLM(**engine_options | {"tp": n}) as llm:
                config, source = llm.engine.config, llm.engine.source
                prompt_ids = [encode_prompt(llm.tokenizer, p) for p in PROMPTS[: args.prompts]]
                print(f"latency: {source.name} ({config.dtype}, {config.device}), tp={n}, "
                      f"{torch.get_num_threads()} threads per rank, {len(prompt_ids)} prompts x {args.max_tokens} "
                      "tokens", file=sys.stderr, flush=True)
                runs[name] = bench_lanner(llm, prompt_ids, args.max_tokens)
                tp = llm.engine.tp
                send_us = tp.send_s / tp.steps * 1e6 if tp is not None and tp.steps else 0.0
                systems[name] = summary(runs[name]) | {"tp": n, "threads_per_rank": torch.get_num_threads(),
                                                        "step_send_us": send_us}
        finally:
            torch.set_num_threads(threads)
        s = systems[name]
        s["ms_per_token"] = 1000 / s["decode_tok_s"] if s["decode_tok_s"] else None
    base = f"lanner tp={sizes[0]}"
    for name, s in systems.items():
        s["speedup_vs_first"] = s["tok_s"] / systems[base]["tok_s"]
        s["greedy_identical_to_first"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs[name], runs[base]))
    result = {"benchmark": "latency_tp", "model": source.name, "model_path": source.path, "tp_sizes": sizes,
              "baseline": base, "max_tokens": args.max_tokens, "prompts": PROMPTS[: args.prompts],
              "env": report.environment(config) | {"torch_threads": threads}, "systems": systems}
    report.write_json(json_path, result)
    report.bar_chart(png_path, list(systems), [s["tok_s"] for s in systems.values()],
                     f"Latency by tensor-parallel size: {source.name}, {config.dtype}, {config.device}",
                     f"output tok/s (incl. prefill, {args.max_tokens} tokens)")
    print(format_tp_table(result))
    print(f"\nwrote {json_path} and {png_path}")
    return result


def format_tp_table(result: dict) -> str:
    rows = [[name, s["threads_per_rank"], report.fmt(s["tok_s"]), report.fmt(s["ms_per_token"], 2),
             report.fmt(s["ttft_s"] and s["ttft_s"] * 1000), report.fmt(s["decode_tok_s"]),
             f"{s['speedup_vs_first']:.2f}x", report.fmt(s["step_send_us"], 0), s["greedy_identical_to_first"]]
            for name, s in result["systems"].items()]
    return (report.markdown_table(["system", "threads/rank", "tok/s", "ms/token (decode)", "TTFT ms", "decode tok/s",
                                   f"vs {result['baseline']}", "step send us", "same tokens"], rows) +
            "\n\n(medians over prompts; tok/s = output tokens / total time including prefill; step send = rank 0's "
            "cost of sending one step to the workers)")
