"""One-shot CUDA check of Lanner on the device machine (random weights: the bundled GGUF does not travel).

1. SmolLM2-135M geometry (random, HF folder): Lanner fp32 logits and greedy tokens vs transformers on CUDA;
2. decode speed bf16 at batch 1 and 8: Lanner vs transformers generate, same weights, same run;
3. tiny DeepSeek-V3.2 / GLM-5 / Qwen3-MoE: Lanner vs transformers greedy tokens + logits on CUDA (fp32).
Writes $OUT/gpu_check.json and prints a summary."""
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())
OUT = os.environ.get("OUT", "/tmp")
res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
import transformers  # noqa: E402

res["transformers"] = transformers.__version__
print(res, flush=True)
from lanner import LLM, SamplingParams  # noqa: E402
from lanner.layers.attention import build_attention_metadata  # noqa: E402
from lanner.models.loader import ModelSource, load_model  # noqa: E402

dev = "cuda"


def hf_greedy(hf, ids, n):
    out, past, x = [], None, torch.tensor([ids], device=dev)
    with torch.no_grad():
        for _ in range(n):
            r = hf(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]], device=dev)
    return out


def lanner_logits(folder, ids, dtype=torch.float32):
    model, cfg = load_model(ModelSource.resolve(folder), dtype, dev)
    nb = (len(ids) + 15) // 16
    kv = [tuple(torch.zeros(nb * 16, *s, dtype=dtype, device=dev) for s in layer) for layer in model.kv_cache_shapes()]
    meta = build_attention_metadata([len(ids)], [len(ids)], [list(range(nb))], 16, dev)
    with torch.inference_mode():
        h, _ = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), kv, meta)
        return model.compute_logits(h).float()


def parity(name, folder, vocab, n_new=16):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (23, 40, 57)]
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompts[1]], device=dev)).logits[0].float()
    diff = (lanner_logits(folder, prompts[1]) - ref_logits).abs().max().item()
    want = [hf_greedy(hf, p, n_new) for p in prompts]
    llm = LLM(model=folder, dtype="float32", device=dev, skip_tokenizer=True, kv_cache_memory="2GiB")
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new,
                                                                        ignore_eos=True))]
    res[name] = {"prefill_max_abs_logit_diff": diff, "greedy_identical": got == want}
    print(name, res[name], flush=True)
    del llm, hf
    torch.cuda.empty_cache()


def step(name, fn):
    t0 = time.time()
    try:
        fn()
    except Exception as e:
        res[name] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
    print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
    json.dump(res, open(os.path.join(OUT, "gpu_check.json"), "w"), indent=2)


def make_smol(folder, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(dtype)
    m.save_pretrained(folder)


SMOL = "/tmp/smol"
step("make_smol", lambda: make_smol(SMOL, torch.float32))
step("smol_parity_fp32", lambda: parity("smol_parity_fp32", SMOL, 49152, 32))


def speed():
    from transformers import AutoModelForCausalLM
    rows = {}
    hf = AutoModelForCausalLM.from_pretrained(SMOL, dtype=torch.bfloat16).to(dev).eval()
    llm = LLM(model=SMOL, dtype="bfloat16", device=dev, skip_tokenizer=True, kv_cache_memory="4GiB",
              max_num_seqs=64)
    n_new, plen = 128, 256
    g = torch.Generator().manual_seed(1)
    for batch in (1, 8, 32):
        prompts = [torch.randint(2, 49152, (plen,), generator=g).tolist() for _ in range(batch)]
        p = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
        llm.generate(prompts, p)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, p)
        torch.cuda.synchronize()
        ours = batch * n_new / (time.perf_counter() - t0)
        x = torch.tensor(prompts, device=dev)
        kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        with torch.no_grad():
            hf.generate(x, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(x, **kw)
            torch.cuda.synchronize()
        theirs = batch * n_new / (time.perf_counter() - t0)
        rows[batch] = {"lanner_tok_s": ours, "hf_tok_s": theirs, "ratio": ours / theirs}
        print("speed", batch, rows[batch], flush=True)
    res["speed_bf16_smol_geometry"] = rows


step("speed", speed)


def tiny(arch):
    from lanner.models.tiny import make_tiny_model
    folder = f"/tmp/tiny_{arch}"
    make_tiny_model(arch, folder)
    parity(f"{arch}_parity_fp32", folder, 160)


for arch in ("deepseek_v32", "glm_moe_dsa"):
    step(arch, lambda a=arch: tiny(a))


def qwen3moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained("/tmp/q3moe")
    parity("qwen3_moe_parity_fp32", "/tmp/q3moe", 512)


step("qwen3_moe", qwen3moe)
print(json.dumps(res, indent=1))
