"""HASS-style draft training on a tiny random target: the loss falls, TTT masks match inference, and the
trained head is accepted more often than an untrained one through the engine's real speculative path."""
import pytest
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
    # packed: two 56-token sequences per forward and optimizer step (the --init run below trains unpacked)
    cfg = TrainConfig(ttt_steps=3, epochs=6, lr=3e-3, warmup_steps=5, grad_accum=1, draft_vocab_size=V,
                      checkpoint_every=10_000, pack_tokens=112)
    head = train_draft_head(target.engine.model, seqs[:40], str(tmp_path / "head"), cfg)
    import json
    hist = json.load(open(tmp_path / "head" / "training.json"))["history"]
    assert hist[-1]["step_losses"][0] < 0.7 * hist[0]["step_losses"][0]
    assert (tmp_path / "head" / "loss.png").exists()
    cost = json.load(open(tmp_path / "head" / "training.json"))["cost"]
    assert cost["train_tokens_processed"] == 6 * 40 * 56 and cost["train_tokens_per_s"] > 0
    assert len(hist) == 6 * 20  # one optimizer step per pack of two
    assert len(list((tmp_path / "head" / "features").iterdir())) == 1  # 40 rows: one stored shard
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

    # --init: continued training starts from the given head (its weights and draft vocabulary), not a new one;
    # trained one sequence per forward, with bfloat16 autocast
    init = DraftHead.load(str(tmp_path / "random"))
    init.d2t.copy_(init.d2t.flip(0))  # a vocabulary order a fresh head would not pick
    init.save(str(tmp_path / "init"))
    cont = train_draft_head(target.engine.model, seqs[:8], str(tmp_path / "cont"),
                            TrainConfig(ttt_steps=2, epochs=1, lr=1e-3, warmup_steps=1, grad_accum=2,
                                        checkpoint_every=10_000, bf16=True), init=str(tmp_path / "init"))
    assert torch.equal(cont.d2t, init.d2t)
    assert json.loads((tmp_path / "cont" / "training.json").read_text())["cost"]["init"] == str(tmp_path / "init")
    changed = [n for n, p in cont.state_dict().items() if p.is_floating_point()
               and not torch.equal(p, init.state_dict()[n])]
    assert changed and all(torch.allclose(p, init.state_dict()[n], atol=0.05) for n, p in cont.state_dict().items()
                           if p.is_floating_point())  # a few small steps away from the init, not a fresh head


def _random_head(vocab=48, seed=0, num_layers=1):
    from lanner.spec.draft_head import DraftHeadConfig

    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                                     target_vocab_size=V, draft_vocab_size=vocab, feature_layers=[1, 2, 3],
                                     num_layers=num_layers))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(std=0.2)  # large enough that a wrong mask, position or shift changes the logits
        head.d2t.copy_(torch.randperm(V)[:vocab])
    return head


def test_two_layer_head_ttt_matches_its_causal_forward_and_is_refused_for_serving(tmp_path):
    """A deeper head (train-curve's depth option): TTT step 0 equals a plain causal forward through both layers,
    step 1 at p equals that forward fed the step-0 output at p - 1 on top of the target context (the chain);
    serving refuses it with the reason."""
    import torch.nn.functional as F

    from lanner.train.hass import ttt_forward

    head = _random_head(num_layers=2).eval()
    embed = torch.nn.Embedding(V, 64)
    g = torch.Generator().manual_seed(3)
    T = 9
    feats, ids = torch.randn(T, 192, generator=g), torch.randint(0, V, (T,), generator=g)
    steps = list(ttt_forward(head, embed, feats, ids, 2))
    pos = torch.arange(T - 1)

    def attend(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, scale=head.scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(len(q), -1)

    with torch.no_grad():
        hidden, tok = head.fuse(feats[:-1]), embed(ids[1:])
        x = head.first_layer_out(hidden, attend(*head.qkv(hidden, tok, pos)))
        layer = head.layers[0]
        out = layer.post(x, attend(*layer.qkv(x, *head.rotary.lookup(pos, x.dtype))))
        assert torch.allclose(steps[0], head.logits(out), atol=1e-5)
        # step 1 at p = 4: the target context 0..3, then the head's step-0 output at 3 with token ids[5]
        p = 4
        h1 = torch.cat([hidden[:p], out[p - 1 : p]])
        t1 = torch.cat([tok[:p], tok[p : p + 1]])
        x = head.first_layer_out(h1, attend(*head.qkv(h1, t1, pos[: p + 1])))
        y = layer.post(x, attend(*layer.qkv(x, *head.rotary.lookup(pos[: p + 1], x.dtype))))
        assert torch.allclose(steps[1][p], head.logits(y)[-1], atol=1e-5)
    head.save(str(tmp_path / "deep"))
    assert DraftHead.load(str(tmp_path / "deep")).cfg.num_layers == 2
    tiny_target(tmp_path / "target")
    with pytest.raises(ValueError, match="2 decoder layers; serving runs one-layer heads"):
        LLM(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB",
            spec="draft", draft=str(tmp_path / "deep"))


def test_packed_batch_equals_sequences_one_at_a_time():
    """Three sequences packed into one TTT forward (block-diagonal attention, positions restarting, the chained
    hidden shifted within each sequence, per-sequence loss masks) give each sequence's logits, losses, accuracies
    and gradient as running it alone."""
    from lanner.train.hass import target_to_draft, ttt_forward, ttt_losses

    head = _random_head()
    embed = torch.nn.Embedding(V, 64)
    t2d = target_to_draft(head, V)
    g = torch.Generator().manual_seed(1)
    seqs = []
    for L, plen in ((11, 3), (7, 5), (14, 2)):  # unequal lengths; the 2nd has a single loss position at step 0
        probs = torch.rand(L, V, generator=g).softmax(-1)
        tp, ti = probs.topk(5, dim=-1)
        seqs.append((torch.randn(L, 192, generator=g), torch.randint(0, V, (L,), generator=g), ti.int(), tp.half(),
                     plen))
    steps = 4
    cat = [torch.cat([s[k] for s in seqs]) for k in range(4)]
    lengths, plens = [len(s[1]) for s in seqs], [s[4] for s in seqs]

    packed = list(ttt_forward(head, embed, cat[0], cat[1], steps, lengths))
    alone = [list(ttt_forward(head, embed, s[0], s[1], steps)) for s in seqs]
    for j in range(steps):
        assert torch.allclose(packed[j], torch.cat([a[j] for a in alone]), atol=1e-5), j

    head.zero_grad()
    total, losses, acc = ttt_losses(head, embed, *cat, t2d, plens, steps, 0.8, lengths=lengths)
    (total / 3).backward()
    grad_packed = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    ref_total = 0.0
    for i, s in enumerate(seqs):
        t, l1, a1 = ttt_losses(head, embed, *s[:4], t2d, s[4], steps, 0.8)
        (t / 3).backward()
        ref_total += float(t.detach())
        assert torch.allclose(torch.tensor([x[i] for x in losses]), torch.tensor(l1), atol=1e-5)
        assert [x[i] for x in acc] == a1
    assert abs(float(total.detach()) - ref_total) < 1e-4
    for gp, p in zip(grad_packed, head.parameters()):
        assert torch.allclose(gp, p.grad, atol=1e-6)


def test_features_are_stored_once_and_read_back(tmp_path):
    """cached_features writes compact shards (bf16 / int32 / fp16) and a later call over the same rows reads them
    without running the target; other rows get shards of their own."""
    from lanner.train.hass import cached_features, target_features

    tiny_target(tmp_path / "target")
    target = LLM(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True,
                 kv_cache_memory="0.05GiB").engine.model
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(0, V, (n,), generator=g).tolist(), 3) for n in (9, 12, 7, 10, 8)]
    first = cached_features(target, rows, str(tmp_path / "f"), [1, 2, 3], 4, shard_size=2)
    assert len(list((tmp_path / "f").iterdir())) == 3
    again = cached_features(None, rows, str(tmp_path / "f"), [1, 2, 3], 4, shard_size=2)  # no target: disk only
    f, ti, tp = target_features(target, rows[3][0], [1, 2, 3], 4)
    got = again[3]
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.int32 and got[3].dtype == torch.float16
    assert torch.equal(got[0], f.bfloat16()) and torch.equal(got[2], ti) and torch.equal(got[3], tp)
    assert got[1].tolist() == rows[3][0] and got[4] == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    cached_features(target, rows[:3], str(tmp_path / "f"), [1, 2, 3], 4, shard_size=2)  # a subset: one new shard
    assert len(list((tmp_path / "f").iterdir())) == 4
    assert len(cached_features(None, rows, str(tmp_path / "f"), [1, 2, 3], 4, shard_size=2)) == 5


def test_train_curve_config_learns_and_reports_cost(tmp_path):
    """train-curve's per-configuration run on stored features: scored at the curve's points (tokens seen), held-out
    first-token agreement rises, cost fields are filled; the MLP width option changes the head's size."""
    from argparse import Namespace

    from lanner.train.curve import parse_configs, train_config
    from lanner.train.hass import TrainConfig, cached_features, training_rows

    tiny_target(tmp_path / "target")
    llm = LLM(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(36)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seqs = [{"prompt_ids": p, "output_ids": o.token_ids} for p, o in zip(prompts, outs)]
    target = llm.engine.model
    layers = [2, 3, 3]
    cache = cached_features(target, training_rows(seqs[:30], 64), str(tmp_path / "f"), layers, 10)
    held = {"held": [(f, i.tolist(), p) for f, i, _, _, p in
                     cached_features(target, training_rows(seqs[30:], 64), str(tmp_path / "h"), layers, 1)]}
    args = Namespace(seed=0, tokens=12_000, points=3, pack_tokens=192, eval_steps=3)
    cfg = TrainConfig(ttt_steps=3, lr=3e-3, warmup_steps=3, grad_accum=1, bf16=False)
    assert parse_configs("64x128,32x256x2") == [(64, 128, 1), (32, 256, 2)]
    r = train_config(target, seqs[:30], cache, held, 64, 128, 1, args, cfg)
    assert [c["point"] for c in r["curve"]] == [0, 3000, 6000, 12_000]
    assert all(c["tokens"] >= c["point"] for c in r["curve"]) and r["tokens"] >= 12_000
    acc0 = [c["held"]["agreement"][0] for c in r["curve"]]
    assert acc0[-1] > acc0[0] + 0.2, acc0
    assert r["tokens_per_s"] > 0 and r["head_ms_per_token"] > 0 and r["train_s"] > 0
    short = Namespace(**{**vars(args), "tokens": 200})
    wide = train_config(target, seqs[:30], cache, held, 64, 256, 1, short, cfg)
    assert wide["params"] - r["params"] == 3 * 64 * 128  # gate, up and down projections one width wider
    deep = train_config(target, seqs[:30], cache, held, 64, 128, 2, short, cfg)
    # one more layer: norms, qkv (4 heads of 16, 2 KV heads), o_proj, the MLP
    assert deep["params"] - r["params"] == 2 * 64 + 64 * 128 + 64 * 64 + 3 * 64 * 128
    assert deep["layers"] == 2 and deep["head_ms_per_token"] > 0


def test_train_base_streams_resumes_and_learns(tmp_path):
    """train-base's streamed run: features made chunk by chunk (a second epoch reads them back), a run stopped by
    --stop-at and continued ends with exactly the head of an uninterrupted run, and held-out agreement rises."""
    from argparse import Namespace

    from lanner.train.base import train_stream
    from lanner.train.hass import cached_features, training_rows

    tiny_target(tmp_path / "target")
    llm = LLM(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(150)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    rows = training_rows([{"prompt_ids": p, "output_ids": o.token_ids} for p, o in zip(prompts, outs)], 64)
    target = llm.engine.model
    held = {"held": [(f, i.tolist(), p) for f, i, _, _, p in
                     cached_features(target, rows[140:], str(tmp_path / "h"), [2, 3, 3], 1)]}
    args = dict(tokens=8_000, stop_at=0, max_len=64, pack_tokens=384, lr=3e-3, ttt_steps=3, eval_steps=3,
                first_point=2000, checkpoint_minutes=0.0, seed=0, draft_vocab_size=V, width=0, no_resume=False)
    runs = {}
    for name, stops in (("whole", [0]), ("resumed", [4000, 0]), ("committed", [4000, 0])):
        for stop in stops:
            a = Namespace(**{**args, "out": str(tmp_path / name), "stop_at": stop})
            runs[name] = train_stream(target, target, rows[:140], held, str(tmp_path / "f"), a, "tiny")
            if name == "committed" and stop:  # another machine: the head and training.json, no optimizer state
                (tmp_path / name / "train_state.pt").unlink()
    assert len(list((tmp_path / "f").iterdir())) == 3  # 140 rows: three shards, made once for both runs
    whole, resumed = (torch.load(tmp_path / n / "train_state.pt", weights_only=False) for n in ("whole", "resumed"))
    assert whole["tokens"] == resumed["tokens"] >= 8_000 and whole["chunk"] > 3  # into the second epoch
    assert all(torch.equal(whole["head"][k], resumed["head"][k]) for k in whole["head"])
    curve = runs["whole"]["curve"]
    assert [r["tokens"] for r in curve] == [r["tokens"] for r in runs["resumed"]["curve"]] == \
        [r["tokens"] for r in runs["committed"]["curve"]]
    assert runs["committed"]["curve"][-1]["held"]["agreement"][0] > curve[0]["held"]["agreement"][0] + 0.2
    assert curve[-1]["held"]["agreement"][0] > curve[0]["held"]["agreement"][0] + 0.2, curve
    assert (tmp_path / "whole" / "model.safetensors").exists() and (tmp_path / "whole" / "curve.png").exists()


def test_greedy_objective_learns_the_top1_that_sampled_acceptance_spreads_over():
    """On flat target distributions speculative sampling's acceptance is served by spreading the draft over the
    top-K; greedy verification keeps a token only when the draft's argmax is the target's top-1. Each objective
    raises its own: "greedy" reaches a top-1 agreement that "lk" does not."""
    from lanner.train.hass import target_to_draft, ttt_losses

    g = torch.Generator().manual_seed(2)
    L = 40
    tp, ti = (torch.rand(L, V, generator=g) * 0.3).softmax(-1).topk(4, dim=-1)
    feats, ids = torch.randn(L, 192, generator=g), torch.randint(0, V, (L,), generator=g)
    top1, neg_log_alpha = {}, {}
    for objective in ("lk", "greedy"):
        head = _random_head(vocab=V)
        embed = torch.nn.Embedding(V, 64)
        t2d = target_to_draft(head, V)
        opt = torch.optim.Adam(head.parameters(), lr=3e-3)
        for _ in range(80):
            total, _, acc = ttt_losses(head, embed, feats, ids, ti.int(), tp.half(), t2d, 0, 1, 1.0,
                                       objective=objective)
            opt.zero_grad()
            total.backward()
            opt.step()
        with torch.no_grad():  # -log of the sampled acceptance sum_x min(p, q) over the rows, after training
            _, (sampled,), _ = ttt_losses(head, embed, feats, ids, ti.int(), tp.half(), t2d, 0, 1, 1.0,
                                          objective="lk", lk_kl_weight=0.0)
        top1[objective], neg_log_alpha[objective] = acc[0], sampled
    assert top1["greedy"] > top1["lk"] + 0.3, top1  # 1.0 against 0.26 here
    assert neg_log_alpha["lk"] < neg_log_alpha["greedy"], neg_log_alpha  # LK keeps the better sampled acceptance


def test_widened_draft_vocabulary_keeps_the_trained_rows_and_adds_the_frequent_tokens(tmp_path):
    """Growing a head's draft vocabulary keeps its rows and ids, appends the answers' most frequent tokens it lacks
    with zero rows, and the head saves and loads at the new size."""
    from lanner.train.hass import draft_vocabulary, new_head, target_to_draft, widen_draft_vocabulary

    tiny_target(tmp_path / "target")
    model = LLM(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True,
                kv_cache_memory="0.05GiB").engine.model
    g = torch.Generator().manual_seed(3)
    seqs = [{"prompt_ids": [1, 2], "output_ids": (torch.randint(0, V, (30,), generator=g) % (7 + i)).tolist()}
            for i in range(40)]
    head = new_head(model, seqs[:10], 16)  # its vocabulary from a tenth of the answers
    with torch.no_grad():
        head.lm_head.weight.add_(torch.randn_like(head.lm_head.weight))  # "trained" rows, unlike the target's
    old_ids, old_rows = head.d2t.clone(), head.lm_head.weight.clone()
    head = widen_draft_vocabulary(head, model, seqs, 24)
    assert head.cfg.draft_vocab_size == len(head.d2t) == head.lm_head.weight.shape[0] == 24
    assert torch.equal(head.d2t[:16], old_ids) and torch.equal(head.lm_head.weight[:16], old_rows)
    added = head.d2t[16:].tolist()
    assert added == [t for t in draft_vocabulary(seqs, V, V).tolist() if t not in set(old_ids.tolist())][:8]
    assert not head.lm_head.weight[16:].any()  # the new rows start off, learned by the training that follows
    assert (target_to_draft(head, V)[head.d2t] == torch.arange(24)).all()
    head.save(str(tmp_path / "wide"))
    assert DraftHead.load(str(tmp_path / "wide")).lm_head.weight.shape == (24, 64)
