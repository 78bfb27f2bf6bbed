"""Time to the first token of Qwen2.5-Coder-1.5B with long prefill steps on the engine's GEMMs (lowlat's
gemm_prefill_from: AMX where PyTorch has it) against lowlat's own prefill (gemm_prefill_from=0), for 2048 / 200 /
100-token prompts, 2 threads, prefix caching off, best of 2. One configuration per run:
Usage: python tools/amx_prefill.py MAX_NUM_BATCHED_TOKENS [GEMM_PREFILL_FROM]   (e.g. 512, 2048, "512 0")"""
import sys
import time

from lanner import LLM, SamplingParams

mnbt, opts = int(sys.argv[1]), {"threads": 2}
if len(sys.argv) > 2:
    opts["gemm_prefill_from"] = int(sys.argv[2])
llm = LLM(model="qwen2.5-coder-1.5b", spec="none", enable_prefix_caching=False, max_num_batched_tokens=mnbt,
          plugin_options={"lowlat": opts})
start = llm.engine.plugins.plugins[0].gemm_prefill_from
text = open(__file__.replace("tools/amx_prefill.py", "docs/quantized.md")).read()
text += open(__file__.replace("tools/amx_prefill.py", "docs/plugins.md")).read()
for n in (2048, 200, 100):
    ids = llm.tokenizer.encode(text)[:n]
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))
        best = min(best, time.perf_counter() - t)
    print(f"max_num_batched_tokens {mnbt}, gemm_prefill_from {start}: {n}-token prompt, TTFT {best:.2f} s", flush=True)
