"""The EAGLE head's drafting cost against a plain decode step (issue 44, item 1): the bundled model, lowlat at 2
threads, the engine's default dtype, 4 MT-Bench prompts x 96 greedy tokens, best of 2. Prints plain tok/s (so ms
per decode step), the head's tau and its drafting ms per verify step (lanner_spec_propose_seconds), whether the
outputs are identical, and where a draft's time goes (the proposer's parts, timed around their calls). Last, the
one-call draft (Head.propose) timed alone for 1 / 3 / 5 draft tokens over 3 new rows: warm (the head's weights in
cache) and cold (a 256 MB buffer summed before each call, as the target's step evicts them in the engine).
Usage: python tools/draft_cost.py [--head-weights q8|dense]"""
import argparse
import collections
import time

import torch

from lanner import LLM, SamplingParams
from lanner.bench.compare import spec_counters, spec_summary
from lanner.spec import proposers
from lanner.train.data import load_eval_set

ap = argparse.ArgumentParser()
ap.add_argument("--head-weights", default="q8", choices=("q8", "dense"), help="lowlat's head_weights option")
lowlat = {"threads": 2, "head_weights": ap.parse_args().head_weights}
prompts = [it["turns"][0] for it in load_eval_set("mtbench", 4)]
sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
res = {}
for spec in ("none", "draft"):
    kw = dict(spec=spec, plugin_options={"lowlat": lowlat})
    if spec == "draft":
        kw.update(draft="default", spec_tokens=3)
    llm = LLM(**kw)
    msgs = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    llm.generate(msgs[:1], SamplingParams(temperature=0, max_tokens=8))
    before = spec_counters(llm.engine)
    best = None
    for _ in range(2):
        t = time.perf_counter()
        outs = [llm.generate([m], sp)[0] for m in msgs]
        d = time.perf_counter() - t
        best = d if best is None else min(best, d)
    s = spec_summary(before, spec_counters(llm.engine))
    res[spec] = (best, s, [o.token_ids for o in outs])
    print(spec, f"wall {best:.2f} s for {len(msgs)}x96 tokens, {len(msgs) * 96 / best:.1f} tok/s",
          {k: v for k, v in s.items() if not isinstance(v, dict)})
    del llm
print("identical", res["none"][2] == res["draft"][2])

# where a head draft's time goes: the proposer's parts, timed around their calls (default head, k = 3)
spent, calls = collections.defaultdict(float), collections.Counter()


def timed(name, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - t
            calls[name] += 1
    return wrapper


P = proposers.DraftHeadProposer
P.propose = timed("propose (all)", P.propose)
P._forward = timed("draft-extend forward (plugin)", P._forward)
P._chain = timed("chain of k - 1 steps (one C++ call)", P._chain)
P._fused = timed("fused: fusion + draft-extend + chain (one C++ call)", P._fused)
llm = LLM(spec="draft", draft="default", spec_tokens=3, plugin_options={"lowlat": lowlat})
llm.engine.proposer.head.fuse = timed("feature fusion (fc, PyTorch)", llm.engine.proposer.head.fuse)
msgs = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
llm.generate(msgs[:1], SamplingParams(temperature=0, max_tokens=8))
spent.clear()
calls.clear()
for m in msgs:
    llm.generate([m], sp)
drafts = calls["propose (all)"]
print(f"per draft ({drafts} drafts):", ", ".join(f"{k} {1e3 * v / drafts:.2f} ms" for k, v in spent.items()))

# the one-call draft alone, warm and cold
plugin = llm.engine.plugins.plugins[0]
head, emb = llm.engine.proposer.head, llm.engine.proposer.embed_weight
kv = torch.zeros(2, 64 * 16, head.Hkv, head.D, dtype=emb.dtype)
feats = torch.randn(3, 3 * head.cfg.hidden_size).to(emb.dtype)
tokens, positions, flush = torch.randint(0, 40000, (3,)), torch.arange(300, 303), torch.randn(64 * 2**20)
for steps in (1, 3, 5):
    for cold in (False, True):
        total = 0.0
        for i in range(31):
            if cold:
                flush.sum()
            t = time.perf_counter()
            plugin.draft_propose(head, emb, feats, tokens, positions, [3], steps, kv[0], kv[1], [list(range(64))], 16)
            total += (time.perf_counter() - t) if i else 0.0  # the first call is a warm-up
        print(f"one call, {steps} draft token(s), {'cold' if cold else 'warm'}: {1e3 * total / 30:.2f} ms")
