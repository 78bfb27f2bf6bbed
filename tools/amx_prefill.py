"""Time to the first token of Qwen2.5-Coder-1.5B with long prefill steps on the engine's GEMMs (lowlat's
gemm_prefill_from: AMX where PyTorch has it) against lowlat's own prefill (gemm_prefill_from=0), for 2048 / 200 /
100-token prompts, 2 threads, prefix caching off, best of 2. One configuration per run (SOLO_PREFILL_TOKENS: the
steps of a lone request, default the plugin's choice; 0: MAX_NUM_BATCHED_TOKENS):
Usage: python tools/amx_prefill.py MAX_NUM_BATCHED_TOKENS [GEMM_PREFILL_FROM [SOLO_PREFILL_TOKENS]]
       (e.g. 512, "512 0", "512 128 0")"""
import sys
import time

from lanner import LLM, SamplingParams

mnbt, opts = int(sys.argv[1]), {"threads": 2}
if len(sys.argv) > 2:
    opts["gemm_prefill_from"] = int(sys.argv[2])
solo = int(sys.argv[3]) if len(sys.argv) > 3 else None
llm = LLM(model="qwen2.5-coder-1.5b", spec="none", enable_prefix_caching=False, max_num_batched_tokens=mnbt,
          solo_prefill_tokens=solo, plugin_options={"lowlat": opts})
start, steps = llm.engine.plugins.plugins[0].gemm_prefill_from, llm.engine.kv.scheduler.solo_budget
text = open(__file__.replace("tools/amx_prefill.py", "docs/quantized.md")).read()
text += open(__file__.replace("tools/amx_prefill.py", "docs/plugins.md")).read()
for n in (2048, 200, 100):
    ids = llm.tokenizer.encode(text)[:n]
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))
        best = min(best, time.perf_counter() - t)
    print(f"max_num_batched_tokens {mnbt}, gemm_prefill_from {start}, lone request's steps {steps}: {n}-token "
          f"prompt, TTFT {best:.2f} s", flush=True)
