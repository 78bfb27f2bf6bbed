"""Block-FP8 checkpoints (DeepSeek-V3 style: float8_e4m3fn weights with `<name>_scale_inv` block scales) are
dequantized at load and give the logits of a transformers model holding the same dequantized weights."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models.loader import ModelSource, _hf_weights, load_model

BLOCK = (16, 16)  # divides none of 40 (hidden), 72 (dense intermediate), 24 (expert intermediate)


def make_hf():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=96, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=72, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128, initializer_range=0.05)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    hf = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif n.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
    return hf


def quantize(w, block):
    """-> (float8 weight, float32 scale per block, the dequantized weight). Independent of the loader's code:
    pads to whole blocks and scales a [blocks_out, bo, blocks_in, bi] view."""
    (bo, bi), (out, inp) = block, w.shape
    so, si = -(-out // bo), -(-inp // bi)
    blocks = F.pad(w, (0, si * bi - inp, 0, so * bo - out)).view(so, bo, si, bi)
    # blocks an order of magnitude apart, so a block given its neighbour's scale shows in the logits
    blocks = blocks * torch.exp(torch.empty(so, 1, si, 1).uniform_(-2.3, 2.3))
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(so * bo, si * bi)[:out, :inp]
    return q.view(so * bo, si * bi)[:out, :inp].contiguous(), scale, deq


def write_fp8_folder(hf, folder, drop_scale=None, block_size=BLOCK):
    """Quantizes every projection (attention, dense MLP, experts) in place in `hf` (it then holds the dequantized
    values) and writes the FP8 checkpoint over two shards, each layer's scales in the other layer's shard."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    # the per-expert names transformers saves
    for k in [k for k in state if k.endswith("experts.gate_up_proj")]:
        stacked, prefix = state.pop(k), k.removesuffix("gate_up_proj")
        for e, w in enumerate(stacked):
            state[f"{prefix}{e}.gate_proj.weight"], state[f"{prefix}{e}.up_proj.weight"] = w.chunk(2)
        for e, w in enumerate(state.pop(prefix + "down_proj")):
            state[f"{prefix}{e}.down_proj.weight"] = w
    shards = ({}, {})
    deq = {}
    for name, w in state.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 1
        if name.endswith("proj.weight"):
            q, scale, deq[name] = quantize(w, BLOCK)
            shards[layer % 2][name] = q
            if name != drop_scale:
                shards[1 - layer % 2][name + "_scale_inv"] = scale
        else:
            shards[layer % 2][name] = w
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f, shard in zip(files, shards):
        save_file(shard, folder / f)
    index = {"weight_map": {n: f for f, shard in zip(files, shards) for n in shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hf.config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if block_size is not None:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block_size)}
    (folder / "config.json").write_text(json.dumps(cfg))
    # the reference model holds exactly what the checkpoint encodes
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in deq.items():
            if ".experts." in name:
                prefix, _, rest = name.partition(".experts.")
                e, proj, _ = rest.split(".")
                e = int(e)
                if proj == "down_proj":
                    params[prefix + ".experts.down_proj"][e].copy_(w)
                else:
                    half = params[prefix + ".experts.gate_up_proj"][e].chunk(2)[proj == "up_proj"]
                    half.copy_(w)
            else:
                params[name].copy_(w)
    return len(deq)


def test_block_fp8_checkpoint_matches_dequantized_transformers(tmp_path):
    hf = make_hf()
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        before = hf(torch.tensor([ids])).logits[0]
    n_quantized = write_fp8_folder(hf, tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ref - before).abs().max() > 1e-3  # quantization moved the logits: the comparison below can tell

    streamed = dict(_hf_weights(str(tmp_path)))
    assert not [n for n in streamed if n.endswith("_scale_inv")]
    fp8_out = [n for n, t in streamed.items() if n.endswith("proj.weight")]
    assert len(fp8_out) == n_quantized and all(streamed[n].dtype == torch.float32 for n in fp8_out)

    model, _ = load_model(ModelSource.resolve(str(tmp_path)), torch.float32, "cpu")
    logits = ModelRunner(model, 4, 16, torch.float32, "cpu").run([SeqChunk(ids, 0, [0, 1], "all")])
    assert (logits - ref).abs().max().item() <= 1e-4


def test_missing_or_mismatched_scale_is_a_clear_error(tmp_path):
    gone = "model.layers.0.self_attn.k_proj.weight"
    (tmp_path / "missing").mkdir()
    write_fp8_folder(make_hf(), tmp_path / "missing", drop_scale=gone)
    with pytest.raises(ValueError, match=r"FP8 weight 'model\.layers\.0\.self_attn\.k_proj\.weight' has no "
                                         r"'model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv'"):
        load_model(ModelSource.resolve(str(tmp_path / "missing")), torch.float32, "cpu")
    # no quantization_config: the default 128x128 blocks do not fit scales written for 16x16
    (tmp_path / "noblock").mkdir()
    write_fp8_folder(make_hf(), tmp_path / "noblock", block_size=None)
    with pytest.raises(ValueError, match=r"scale shape \(\d+, \d+\), expected \(1, 1\)"):
        load_model(ModelSource.resolve(str(tmp_path / "noblock")), torch.float32, "cpu")


def test_scales_without_an_fp8_weight_are_refused(tmp_path):
    (tmp_path / "orphan").mkdir()
    save_file({"a.weight": torch.zeros(4, 4), "b.weight_scale_inv": torch.ones(1, 1)},
              tmp_path / "orphan" / "model.safetensors")
    with pytest.raises(ValueError, match=r"scales without their weight: \['b\.weight_scale_inv'\]"):
        list(_hf_weights(str(tmp_path / "orphan")))
    (tmp_path / "float").mkdir()
    save_file({"a.weight": torch.zeros(4, 4), "a.weight_scale_inv": torch.ones(1, 1)},
              tmp_path / "float" / "model.safetensors")
    with pytest.raises(ValueError, match=r"'a\.weight' has a 'a\.weight_scale_inv' but is torch\.float32, not FP8"):
        list(_hf_weights(str(tmp_path / "float")))
