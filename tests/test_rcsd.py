"""RCSD on a tiny random target: unverified drafting in the engine, chain log-likelihoods that agree with what
the head proposed at inference, and DPO / GRPO training that moves the head toward the target's sequences."""
import json

import pytest
import torch
from test_train_hass import V, tiny_target

from lanner import LLM, SamplingParams
from lanner.engine.llm_engine import RequestError
from lanner.spec.draft_head import DraftHead
from lanner.train import rcsd
from lanner.train.hass import TrainConfig, target_to_draft, train_draft_head
from lanner.train.rcsd import (
    RCSDConfig,
    Sequence,
    chain_pattern,
    chain_steps,
    generate_sequences,
    grpo_advantages,
    group_loss,
    train_rcsd,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("rcsd")
    tiny_target(tmp / "target")
    kw = dict(model=str(tmp / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB")
    target = LLM(**kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(40)]
    outs = target.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seqs = [{"prompt_ids": p, "output_ids": o.token_ids} for p, o in zip(prompts, outs)]
    train_draft_head(target.engine.model, seqs, str(tmp / "hass"),
                     TrainConfig(ttt_steps=3, epochs=2, lr=3e-3, warmup_steps=5, grad_accum=2, draft_vocab_size=V,
                                 checkpoint_every=10_000))
    spec = LLM(spec="draft", draft=str(tmp / "hass"), spec_tokens=3, **kw)
    return tmp, target, spec, prompts


class _Ids:
    """Token-id prompts for generate_sequences on a tokenizer-less engine."""

    def __init__(self, llm):
        self.llm, self.tokenizer = llm, self

    def apply_chat_template(self, messages):
        return [int(t) for t in messages[0]["content"].split()]

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params)


def test_chain_helpers():
    assert chain_pattern(7, 2) == [0, 1, 1, 0, 1, 1, 0]
    assert chain_steps([0, 1, 1, 0, 1], offset=10) == ([11, 12, 14], [0, 1, 0])


def test_unverified_drafting_records_who_wrote_each_token(setup):
    tmp, target, spec, prompts = setup
    out = spec.generate(prompts[0], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True,
                                                   unverified_draft=3))[0]
    assert out.draft_sources == chain_pattern(13, 3)
    # every target-written token is the target's greedy choice after what was written before it
    for i, s in enumerate(out.draft_sources):
        if not s:
            nxt = target.generate(prompts[0] + out.token_ids[:i], SamplingParams(temperature=0, max_tokens=1))[0]
            assert nxt.token_ids == [out.token_ids[i]]
    with pytest.raises(RequestError, match="unverified_draft needs an engine with a draft"):
        target.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, unverified_draft=2))
    with pytest.raises(ValueError, match="unverified_draft: needs greedy decoding"):
        SamplingParams(temperature=0.7, unverified_draft=2)


def test_chain_logprobs_see_what_the_head_proposed(setup):
    """The draft wrote each token greedily through its inference chain, so the training-side chain scoring must
    rank exactly that token first at every draft-written position: the two paths index the same computation."""
    tmp, target, spec, prompts = setup
    rows = generate_sequences(_Ids(spec), [{"id": str(i), "turns": [" ".join(map(str, p))]}
                                           for i, p in enumerate(prompts[:6])], str(tmp / "seqs.jsonl"), [3],
                              max_new_tokens=24)
    assert sorted((r["id"], r["k"]) for r in rows) == sorted((str(i), k) for i in range(6) for k in (0, 3))
    head = DraftHead.load(str(tmp / "hass"))
    t2d = target_to_draft(head, V)
    embed = torch.nn.Embedding.from_pretrained(target.engine.model.embed_tokens.weight.float())
    for r in [r for r in rows if r["k"] == 3]:
        s = Sequence(r, target.engine.model, head, t2d, 3, 640)
        assert len(s.steps) == sum(r["sources"]) and set(s.steps.tolist()) == {0, 1, 2}
        lp = s.chain_logprobs(head, embed)
        best = torch.tensor([max(lp_j) for lp_j in _all_step_logprobs(s, head, embed)])
        torch.testing.assert_close(lp, best, atol=1e-4, rtol=0)
    # the target-only sequence is the target's greedy text: acceptance 1 at its pattern positions, and the target
    # finds it likelier than the one the draft co-wrote
    pairs = [[Sequence(next(r for r in rows if r["k"] == k and r["id"] == str(i)), target.engine.model, head, t2d,
                       3, 640) for k in (0, 3)] for i in range(6)]
    assert all(good.acceptance == 1.0 for good, _ in pairs) and min(bad.acceptance for _, bad in pairs) < 1.0
    assert all(good.target_logprob >= bad.target_logprob - 1e-5 for good, bad in pairs)
    assert any(good.target_logprob > bad.target_logprob for good, bad in pairs)


def _all_step_logprobs(s, head, embed):
    from lanner.train.hass import ttt_forward
    logps = [lg.float().log_softmax(-1) for lg in ttt_forward(head, embed, s.feats.float(), s.ids, s.num_steps)]
    return [logps[j][p] for j, p in zip(s.steps.tolist(), s.pos.tolist())]


@pytest.mark.parametrize("method", ["dpo", "grpo", "lk"])
def test_training_moves_the_head_toward_the_target(setup, method, monkeypatch):
    tmp, target, spec, prompts = setup
    cfg = RCSDConfig(method=method, k=3, ks=(1, 2, 3), epochs=3, lr=2e-3, warmup_steps=2, grad_accum=2,
                     beta=0.1, checkpoint_every=10_000, bf16=method == "lk")  # LK trains under bf16 autocast
    items = [{"id": str(i), "turns": [" ".join(map(str, p))]} for i, p in enumerate(prompts[:16])]
    rows = generate_sequences(_Ids(spec), items, str(tmp / f"{method}.jsonl"), cfg.draft_lengths, max_new_tokens=24)
    # a prompt longer than max_len: no output within it, so it is left out
    long = [{"id": "long", "k": k, "prompt_ids": [1] * (cfg.max_len + 10), "output_ids": [2] * 30, "sources": [0] * 30}
            for k in [0, *cfg.draft_lengths]]
    train_rcsd(target.engine.model, str(tmp / "hass"), rows + long, str(tmp / method), cfg)
    training = json.load(open(tmp / method / "training.json"))
    hist = training["history"]
    assert training["cost"]["prompts"] == len(items)
    assert (tmp / method / "curves.png").stat().st_size > 0
    if method == "dpo":
        assert hist[0]["loss"] == pytest.approx(0.693, abs=0.05)  # the policy starts as the reference
        assert hist[-1]["loss"] < 0.6 and hist[-1]["reward"] > 0
        # a rerun from scratch reads the stored features and reference scores back, and trains the same head
        monkeypatch.setattr(rcsd, "target_pass", lambda *a, **k: pytest.fail("features computed again"))
        train_rcsd(target.engine.model, str(tmp / "hass"), rows + long, str(tmp / "again"), cfg, resume=False,
                   prep_dir=str(tmp / method))
        again, first = DraftHead.load(str(tmp / "again")), DraftHead.load(str(tmp / method))
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), first.state_dict().values()))
        changed = [dict(r, output_ids=r["output_ids"][:-1] + [r["output_ids"][-1] + 1]) if r is rows[0] else r
                   for r in rows]
        with pytest.raises(pytest.fail.Exception, match="features computed again"):  # a changed sequence: recomputed
            train_rcsd(target.engine.model, str(tmp / "hass"), changed, str(tmp / "again"), cfg, resume=False,
                       prep_dir=str(tmp / method))
    elif method == "lk":  # the control trains on the target's own sequences only, toward acceptance
        assert {r["k"] for r in rows} == {0}
        model = target.engine.model
        embed = torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.float())

        def lk_loss(head):  # the objective over the same sequences, before and after training
            t2d = target_to_draft(head, V)
            with torch.no_grad():
                return sum(float(group_loss(head, embed, t2d, [Sequence(r, model, head, t2d, cfg.k, cfg.max_len)],
                                            cfg)[0]) for r in rows) / len(rows)
        before, after = lk_loss(DraftHead.load(str(tmp / "hass"))), lk_loss(DraftHead.load(str(tmp / method)))
        assert after < 0.95 * before  # 2.75 -> 2.37 here
    else:
        # sequences with a high advantage (the target's own first) became likelier under the draft, low ones less
        assert hist[-1]["reward"] > 0 and hist[-1]["kl"] > 0
    # the trained head still serves, losslessly
    out = LLM(spec="draft", draft=str(tmp / method), spec_tokens=3, model=str(tmp / "target"), dtype="float32",
              skip_tokenizer=True, kv_cache_memory="0.05GiB").generate(
        prompts[20:24], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    plain = target.generate(prompts[20:24], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_config_names_a_setting_its_method_does_not_have():
    with pytest.raises(ValueError, match="accept: chooses the LK objective; method 'dpo'"):
        RCSDConfig(method="dpo", accept="greedy")
    assert RCSDConfig(method="lk", accept="greedy").accept == "greedy"


def test_grpo_advantages_prefer_the_target_like_sequence():
    class S:
        def __init__(self, lp, acc):
            self.target_logprob, self.acceptance = lp, acc
    adv = grpo_advantages([S(-0.5, 1.0), S(-2.0, 0.4), S(-1.5, 0.6), S(-1.0, 0.8)])
    assert adv.argmax() == 0 and adv.argmin() == 1 and abs(float(adv.mean())) < 1e-5


def test_cli_runs_on_the_default_model_and_head(tmp_path):
    """The real pipeline: ShareGPT prompts, the bundled model, the shipped HASS head as init and reference."""
    import subprocess
    import sys
    from pathlib import Path

    lanner = str(Path(sys.executable).with_name("lanner"))
    r = subprocess.run([lanner, "rcsd", "--method", "grpo", "--num-prompts", "2", "--max-new-tokens", "10",
                        "--epochs", "1", "--grad-accum", "1", "--out", str(tmp_path / "head"), "--data",
                        str(tmp_path / "seqs.jsonl"), "--kv-cache-memory", "0.25GiB"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "seqs.jsonl")]
    assert sorted(r["k"] for r in rows) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(r["output_ids"]) == len(r["sources"]) == 10 for r in rows if r["k"])
    assert DraftHead.load(str(tmp_path / "head")).cfg.draft_vocab_size == 4096
    assert json.load(open(tmp_path / "head" / "training.json"))["cost"]["prompts"] == 2
