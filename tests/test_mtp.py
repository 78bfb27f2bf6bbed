"""MTP drafting (draft="mtp"): the target checkpoint's own multi-token prediction layer on tiny random DeepSeek-V3.2
and GLM-5 checkpoints, float32. The module's logits match a reference built from transformers' decoder layer; greedy
decoding with it is token-identical to plain decoding."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lanner import LLM, SamplingParams
from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.models.loader import ModelSource, load_model
from lanner.models.tiny import make_tiny_model
from lanner.plugins import StepKind
from lanner.spec.mtp import MtpProposer, load_mtp

ARCHS = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek-V3.2's folder has the MTP layer's own embedding and head copies
TOL = 1e-4


def rand_ids(n, seed, vocab=160):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_config(folder):
    with open(f"{folder}/config.json") as f:
        return json.load(f)


def reference_layer(folder, tmp_path):
    """transformers' own 1-layer model holding the MTP layer's decoder layer, with shared_head as its final norm and
    LM head: fed the MTP input (eh_proj's output) as inputs_embeds, its logits are the MTP's."""
    from transformers import AutoModelForCausalLM

    cfg = read_config(folder)
    n = cfg["num_hidden_layers"]
    w = load_file(f"{folder}/model.safetensors")
    p = f"model.layers.{n}."
    one = {k.replace(p, "model.layers.0."): v for k, v in w.items() if k.startswith(p)}
    one["model.norm.weight"] = one.pop("model.layers.0.shared_head.norm.weight")
    one["lm_head.weight"] = one.pop("model.layers.0.shared_head.head.weight", w["lm_head.weight"])
    one["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]  # unused (inputs_embeds)
    for k in ("enorm", "hnorm", "eh_proj", "embed_tokens"):
        one.pop(f"model.layers.0.{k}.weight", None)
    save_file(one, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg |= {"num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "first_k_dense_replace": 0,
            "layer_types": cfg["layer_types"][:1]}
    if cfg.get("indexer_types"):
        cfg["indexer_types"] = ["full"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_logits_match_a_reference(arch, tmp_path):
    folder = make_tiny_model(arch, str(tmp_path / "model"), mtp=True)
    model, cfg = load_model(ModelSource.resolve(folder), torch.float32, "cpu")
    mtp = load_mtp(ModelSource.resolve(folder), model, torch.float32, "cpu")
    assert (mtp.embed_tokens is not None) == (arch == "deepseek_v32")
    ids = rand_ids(25, 1)  # 24 MTP rows: more than index_topk (16), so the MTP layer's indexer drops tokens
    n, table = len(ids), [0, 1, 2, 3]
    # the target feature: the last layer's output, the hidden state before the final norm
    runner = ModelRunner(model, 8, 8, torch.float32, "cpu", capture_layers=(cfg.num_layers - 1,))
    logits = runner.run([SeqChunk(ids, 0, table, "all")])
    h = runner.features
    assert (model.compute_logits(model.norm(h)) - logits).abs().max() <= TOL
    prop = MtpProposer(mtp, model, 8, 8, torch.float32, "cpu")
    # draft-extend over positions 0..n-2 (h_p, token p+1), then one chained step feeding its own hidden state back
    got, out = prop._forward(StepKind.DRAFT_EXTEND, h[:-1], ids[1:], list(range(n - 1)), [n - 1], [n - 1], [table])
    d = int(got[-1].argmax())
    got2, _ = prop._forward(StepKind.DRAFT, out[-1:], [d], [n - 1], [1], [n], [table])

    emb = model.embed_tokens.weight if mtp.embed_tokens is None else mtp.embed_tokens.weight
    x = mtp.eh_proj(torch.cat([mtp.enorm(emb[ids[1:] + [d]]), mtp.hnorm(torch.cat([h[:-1], out[-1:]]))], dim=-1))
    with torch.no_grad():
        ref = reference_layer(folder, tmp_path).forward(inputs_embeds=x[None]).logits[0]
    assert (got - ref[:-1]).abs().max() <= TOL
    assert (got2[0] - ref[-1]).abs().max() <= TOL


def predictable(folder):
    """Weights under which the target is close to a bigram model (large embeddings, small layer outputs) and the
    MTP layer close to that bigram's next step (eh_proj passes the embedding through; shared_head.norm is the
    final norm): drafts are often accepted, deep chain positions included, and still sometimes rejected."""
    w = load_file(f"{folder}/model.safetensors")
    n = read_config(folder)["num_hidden_layers"]
    p = f"model.layers.{n}."
    for k in w:
        if k.endswith("embed_tokens.weight"):
            w[k] = w[k] * 10
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * 0.1
    h = w["model.norm.weight"].shape[0]
    w[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    w[p + "enorm.weight"] = torch.ones(h)
    w[p + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_greedy_is_lossless(arch, tmp_path):
    folder = predictable(make_tiny_model(arch, str(tmp_path), mtp=True))
    kw = {"model": folder, "dtype": "float32", "skip_tokenizer": True, "block_size": 8, "kv_cache_memory": "0.01GiB",
          "max_num_batched_tokens": 24}  # the longest prompt is prefilled in chunks
    prompts = [rand_ids(37, 2), rand_ids(22, 3), rand_ids(9, 4)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = LLM(**kw)
    plain = [o.token_ids for o in base.generate(prompts, greedy)]
    llm = LLM(**kw, spec="draft", draft="mtp")
    assert type(llm.engine.proposer) is MtpProposer
    # the MTP layer's latent + index-key cache shares the KV budget: one layer more than the target's
    t = ModelRunner.bytes_per_token(base.engine.model, torch.float32)
    m = ModelRunner.bytes_per_token(llm.engine.proposer.mtp, torch.float32)
    assert m == 4 * (40 + 16) and abs(llm.engine.kv.num_blocks - base.engine.kv.num_blocks * t / (t + m)) <= 1
    accepted = [0, 0, 0]
    for k in (1, 2, 3):
        llm.engine.config.spec_tokens = k  # read every step: one engine serves every k
        outs = llm.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == plain, f"k={k}"
        assert [llm.generate(p, greedy)[0].token_ids for p in prompts[:2]] == plain[:2], f"k={k} alone"
        for o in outs:
            assert o.metrics["spec_verify_steps"] > 0 and o.metrics["spec_accept_length"] >= 1
            for i, a in enumerate(o.metrics["spec_accepted_per_position"]):
                accepted[i] += a
            assert o.metrics["spec_accept_length"] < k + 1  # some drafts were rejected
        assert llm.engine.kv.block_manager.num_used == 0
    assert all(a > 0 for a in accepted)  # every chain position was accepted somewhere
    sampled = llm.generate(prompts[1], SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True))[0]
    assert len(sampled.token_ids) == 10 and sampled.metrics["spec_verify_steps"] > 0


def test_clear_errors_without_an_mtp_layer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    no_mtp = make_tiny_model("glm_moe_dsa", str(tmp_path / "glm"))
    with pytest.raises(ValueError, match="no MTP"):
        LLM(model=no_mtp, dtype="float32", skip_tokenizer=True, kv_cache_memory="0.01GiB", spec="draft", draft="mtp")
    llama = str(tmp_path / "llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(llama)
    with pytest.raises(ValueError, match="DeepSeek-family"):
        LLM(model=llama, dtype="float32", skip_tokenizer=True, kv_cache_memory="0.01GiB", spec="draft", draft="mtp")
    shutil.rmtree(llama)
