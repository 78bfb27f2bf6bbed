"""Lanner's model code against Hugging Face transformers on the same weights."""
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lanner import LLM, SamplingParams
from lanner.layers.attention import build_attention_metadata
from lanner.models.config import UnsupportedModelError
from lanner.models.loader import ModelSource, load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of three fruits: apple,",
    "<|im_start|>user\nExplain gravity in one sentence.<|im_end|>\n<|im_start|>assistant\n",
]


def lanner_logits(model, ids):
    cfg = model.cfg
    bs, nb = 16, (len(ids) + 15) // 16
    kv = [(torch.zeros(nb * bs, cfg.num_kv_heads, cfg.head_dim), torch.zeros(nb * bs, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([len(ids)], [len(ids)], [list(range(nb))], bs, "cpu")
    with torch.inference_mode():
        h, _ = model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
        return model.compute_logits(h)


@pytest.fixture(scope="module")
def hf_gguf(default_gguf):
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf),
                                                dtype=torch.float32).eval()


def test_default_model_logits_match_transformers(llm32, hf_gguf):
    tok = llm32.tokenizer
    for p in PROMPTS:
        ids = tok.encode(p)
        ours = lanner_logits(llm32.engine.model, ids)
        with torch.no_grad():
            ref = hf_gguf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-3, p


def hf_greedy(hf, ids, n):
    """Plain argmax loop with HF's KV cache (generate()'s min_new_tokens would mask EOS, ignore_eos does not)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = hf(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def test_default_model_greedy_64_tokens_match_transformers(llm32, hf_gguf):
    tok = llm32.tokenizer
    outs = llm32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for p, out in zip(PROMPTS, outs):
        ids = tok.encode(p)
        assert out.token_ids == hf_greedy(hf_gguf, ids, 64), p


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("MistralForCausalLM", {"sliding_window": None}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen3ForCausalLM", {"head_dim": 32}),
])
def test_hf_folder_architectures_match_transformers(tmp_path, arch, extra):
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[arch]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **TINY, **extra)
    cfg.architectures = [arch]
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random non-trivial norm weights and biases, so every parameter matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path)
    model, mcfg = load_model(ModelSource.resolve(str(tmp_path)), torch.float32, "cpu")
    ids = torch.randint(0, 128, (100,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (lanner_logits(model, ids) - ref).abs().max().item() <= 1e-4


def test_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8}))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_missing_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(model="/nonexistent/model")
