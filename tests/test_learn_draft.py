"""--learn-draft: the engine keeps the target's verified features of served requests, the background trainer
(a real subprocess) trains on them and publishes a head that accepts more, the engine swaps it in between
steps, outputs stay identical to plain decoding, and a restart serves the learned head."""
import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from lanner import LLM, SamplingParams
from lanner.spec.draft_head import DraftHead, random_draft_head
from lanner.spec.learn import published_head
from lanner.train.hass import target_features
from lanner.train.online import OnlineTrainer, load_sample
from tests.test_train_hass import V, tiny_target

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def live_tau(outs) -> float:
    steps = sum(o.metrics["spec_verify_steps"] for o in outs)
    return sum(o.metrics["spec_accept_length"] * o.metrics["spec_verify_steps"] for o in outs) / steps


def test_learn_draft_from_served_traffic(tmp_path):
    tiny_target(tmp_path / "target")
    kw = dict(model=str(tmp_path / "target"), dtype="float32", skip_tokenizer=True, kv_cache_memory="0.05GiB")
    plain = LLM(**kw)
    random_draft_head(plain.engine.model_config, V, seed=3).save(str(tmp_path / "base"))
    g = torch.Generator().manual_seed(1)
    waves = [[torch.randint(0, V, (8,), generator=g).tolist() for _ in range(32)] for _ in range(3)]
    expected = [[o.token_ids for o in plain.generate(w, GREEDY)] for w in waves]

    folder = str(tmp_path / "learn")
    os.makedirs(folder)
    with open(os.path.join(folder, "learner.json"), "w") as f:  # the trainer's settings, kept by the engine
        json.dump({"lr": 3e-3, "warmup_steps": 1, "holdout": 8, "round_samples": 24, "poll_s": 0.1,
                   "grad_accum": 2}, f)
    spec = LLM(spec="draft", draft=str(tmp_path / "base"), spec_tokens=3, spec_max_batch=32, learn_draft=folder, **kw)
    learner = spec.engine.spec.learner
    outs = spec.generate(waves[0], GREEDY)
    assert [o.token_ids for o in outs] == expected[0]
    tau_random = live_tau(outs)
    learner.flush()

    # each completed request is a sample: its features are the target's, position for position
    names = sorted(os.listdir(os.path.join(folder, "traffic")))
    assert len(names) == 32
    feats, ids, loss_from = load_sample(os.path.join(folder, "traffic", names[0]), 1024)
    assert len(ids) == 48 and loss_from == 8 and feats.shape[0] == 47
    ref, _, _ = target_features(plain.engine.model, ids, DraftHead.load(str(tmp_path / "base")).cfg.feature_layers, 1)
    torch.testing.assert_close(feats, ref[:47].to(torch.bfloat16).float())

    # the trainer publishes a head that beats the served one on held-back traffic; the engine swaps it in
    deadline = time.time() + 120
    while published_head(folder) is None and time.time() < deadline:
        time.sleep(0.2)
    assert published_head(folder) is not None, open(os.path.join(folder, "trainer.log")).read()
    rounds = [json.loads(line) for line in open(os.path.join(folder, "rounds.jsonl"))]
    assert any(r["published"] and r["student_tau"] > r["served_tau"] for r in rounds)
    for wave, exp in zip(waves[1:], expected[1:]):
        outs = spec.generate(wave, GREEDY)  # its first step polls
        assert [o.token_ids for o in outs] == exp  # lossless with whatever head is served
    assert learner.version >= 1
    served = learner.head.state_dict()
    newest = load_file(os.path.join(folder, "heads", f"v{learner.version}", "model.safetensors"))
    assert all(torch.equal(served[k], newest[k].to(served[k].dtype)) for k in newest)
    assert live_tau(outs) > tau_random + 0.15, (live_tau(outs), tau_random)
    spec.close()
    assert learner.trainer.poll() is not None  # stopped with the engine

    # a restart serves the newest learned head, and the trainer resumes its student
    version = json.load(open(os.path.join(folder, "current.json")))["version"]
    again = LLM(spec="draft", draft=str(tmp_path / "base"), spec_tokens=3, learn_draft=folder, **kw)
    head = again.engine.spec.learner.head.state_dict()
    newest = load_file(os.path.join(folder, "heads", f"v{version}", "model.safetensors"))
    assert all(torch.equal(head[k], newest[k].to(head[k].dtype)) for k in newest)
    again.close()
    resumed = OnlineTrainer(folder)
    assert resumed.version == version and len(resumed.seen) >= 8 and resumed.opt_steps > 0


def test_learn_draft_needs_a_head(tmp_path):
    from lanner.config import EngineConfig

    with pytest.raises(ValueError, match="learn_draft: trains the draft head; it needs spec='draft' or 'hybrid'"):
        EngineConfig(spec="ngram", learn_draft=str(tmp_path))
    with pytest.raises(ValueError, match="learn_draft: continual learning runs with tp=1 only"):
        EngineConfig(spec="draft", draft="default", learn_draft=str(tmp_path), tp=2)
