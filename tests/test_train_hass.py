"""HASS-style draft training on a tiny random target: the loss falls, TTT masks match inference, and the
trained head is accepted more often than an untrained one through the engine's real speculative path."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lanner import LLM, SamplingParams
from lanner.spec.draft_head import DraftHead, random_draft_head
from lanner.train.eval_head import offline_agreement
from lanner.train.hass import TrainConfig, train_draft_head

V = 64


def tiny_target(path):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked, so greedy continuations have structure to learn
    model.save_pretrained(path)


def test_training_raises_acceptance(tmp_path):
    tiny_target(tmp_path / "target")
    kw = dict(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB")
    target = LLM(**kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(48)]
    outs = target.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    seqs = [{"prompt_ids": p, "output_ids": o.token_ids} for p, o in zip(prompts, outs)]
    cfg = TrainConfig(ttt_steps=3, epochs=6, lr=3e-3, warmup_steps=5, grad_accum=2, draft_vocab_size=V,
                      checkpoint_every=10_000)
    head = train_draft_head(target.engine.model, seqs[:40], str(tmp_path / "head"), cfg)
    import json
    hist = json.load(open(tmp_path / "head" / "training.json"))["history"]
    assert hist[-1]["step_losses"][0] < 0.7 * hist[0]["step_losses"][0]
    assert (tmp_path / "head" / "loss.png").exists()
    assert isinstance(DraftHead.load(str(tmp_path / "head")), DraftHead) and head.cfg.feature_layers == [2, 3, 3]

    random_draft_head(target.engine.model_config, V, seed=3).save(str(tmp_path / "random"))
    taus, live_first = {}, {}
    for name in ("head", "random"):
        spec = LLM(spec="draft", draft=str(tmp_path / name), spec_tokens=3, spec_max_batch=16, **kw)
        res = spec.generate(prompts[40:], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        assert [o.token_ids for o in res] == [o.token_ids for o in outs[40:]]  # lossless either way
        emitted = sum(o.metrics["spec_accept_length"] * o.metrics["spec_verify_steps"] for o in res)
        taus[name] = emitted / sum(o.metrics["spec_verify_steps"] for o in res)
        live_first[name] = sum(o.metrics["spec_accepted_per_position"][0] for o in res) / \
            sum(o.metrics["spec_verify_steps"] for o in res)
    assert taus["head"] > taus["random"] + 0.3, taus

    # eval-head: the engine's greedy walk replayed on the head's offline (training-time-test) predictions gives
    # the live acceptance and tau: training and serving feed the head alike. Every token is in its vocabulary.
    held_out = [(p + o.token_ids, len(p)) for p, o in zip(prompts[40:], outs[40:])]
    for name in ("head", "random"):
        off = offline_agreement(target.engine.model, DraftHead.load(str(tmp_path / name)), held_out, 3)
        assert off["coverage"] == 1.0
        assert abs(off["replay_accept_at"][0] - live_first[name]) < 0.03, (name, off, live_first)
        assert abs(off["replay_tau"] - taus[name]) < 0.05, (name, off, taus)

    # --init: continued training starts from the given head (its weights and draft vocabulary), not a new one
    init = DraftHead.load(str(tmp_path / "random"))
    init.d2t.copy_(init.d2t.flip(0))  # a vocabulary order a fresh head would not pick
    init.save(str(tmp_path / "init"))
    cont = train_draft_head(target.engine.model, seqs[:8], str(tmp_path / "cont"),
                            TrainConfig(ttt_steps=2, epochs=1, lr=1e-3, warmup_steps=1, grad_accum=2,
                                        checkpoint_every=10_000), init=str(tmp_path / "init"))
    assert torch.equal(cont.d2t, init.d2t)
    assert json.loads((tmp_path / "cont" / "training.json").read_text())["cost"]["init"] == str(tmp_path / "init")
    changed = [n for n, p in cont.state_dict().items() if p.is_floating_point()
               and not torch.equal(p, init.state_dict()[n])]
    assert changed and all(torch.allclose(p, init.state_dict()[n], atol=0.05) for n, p in cont.state_dict().items()
                           if p.is_floating_point())  # a few small steps away from the init, not a fresh head
