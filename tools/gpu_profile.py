"""torch.profiler of Lanner's decode steps on CUDA at batch 8 (random SmolLM2-geometry weights)."""
import os, sys
import torch
sys.path.insert(0, os.getcwd())
from transformers import LlamaConfig, LlamaForCausalLM
from lanner import LLM, SamplingParams
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained("/tmp/smol")
llm = LLM(model="/tmp/smol", dtype="bfloat16", device="cuda", skip_tokenizer=True, kv_cache_memory="4GiB")
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(2, 49152, (256,), generator=g).tolist() for _ in range(8)]
p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts, p)
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, p)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
