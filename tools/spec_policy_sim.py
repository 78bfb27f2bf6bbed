"""The hybrid proposer's suffix-draft rule, replayed offline over the agent-session replay: the turns' greedy outputs
(plain decoding, bundled model, lowlat), then per turn the suffix drafts at every step (the real index, own and
shared, fed the turns in the replay's order), the prefix a rule verifies, the tokens it gets accepted (the draft's
match with the real continuation: greedy speculation emits plain greedy's text) and the step's time from a cost
table (ms by rows; default: the medians `tools/replay_step_profile.py hybrid q16` measured, one thread). Per rule:
per-turn decode speed P50 and mean, verify steps, drafted and accepted tokens. Rules:
- none: plain decoding;
- global: the expected tokens of the index's frequencies times one accepted / predicted over the recent drafts
  (the rule before lanner.spec.hybrid.Acceptance);
- shipped: lanner.spec.hybrid's best_suffix (Acceptance: per frequency and match-length bucket);
- oracle: the longest accepted prefix (an upper bound no rule reaches).
Both rules weigh rows with the hybrid's own StepCost line, fitted (as in the engine) over the forward times the
replay charges them. Writes results/spec_policy_sim.json.
Usage: python tools/spec_policy_sim.py [--outputs FILE (cached greedy outputs)] [--cost-ms 5.71,6.58,...]
       [--row-ms 2.2] [--rest-ms 0.8]"""
import argparse
import json
import os
import statistics
from types import SimpleNamespace

from lanner.bench.sessions import DEFAULT_SESSIONS, assistant_prompts, load_sessions
from lanner.spec.hybrid import CALIB_DECAY, HybridProposer, HybridState, StepCost
from lanner.spec.suffix import SuffixProposer, SuffixState

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--outputs", default="/tmp/lanner_replay_greedy.json", help="greedy outputs (made when missing)")
ap.add_argument("--cost-ms", default="5.71,6.58,9.20,11.29,13.95,16.87,18.24,24.56,27.58",
                help="forward + verification ms by rows 1, 2, ..; past the table each row adds --row-ms")
ap.add_argument("--row-ms", type=float, default=2.2)
ap.add_argument("--rest-ms", type=float, default=0.8, help="engine time per step outside the forward")
args = ap.parse_args()
table = [float(v) for v in args.cost_ms.split(",")]


def forward_ms(rows: int) -> float:
    return table[rows - 1] if rows <= len(table) else table[-1] + args.row_ms * (rows - len(table))


if not os.path.exists(args.outputs):
    import torch

    from lanner import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(spec=None, plugin="lowlat", plugin_options={"lowlat": {"threads": 1}})
    turns = []
    for s in load_sessions(DEFAULT_SESSIONS):
        for k, (ids, n, _) in enumerate(assistant_prompts(s, llm.tokenizer, "replay c=1")):
            out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            turns.append({"session": s["id"], "turn": k + 1, "prompt": ids, "max_tokens": n,
                          "output": list(out.token_ids)})
            print(f"greedy output {len(turns)}: {len(out.token_ids)} tokens", flush=True)
    with open(args.outputs, "w") as f:
        json.dump(turns, f)
turns = json.load(open(args.outputs))


class Shipped:
    def __init__(self):
        self.p = HybridProposer(suffix=SuffixProposer(), head=None, head_tokens=0)
        self.cost = self.p.cost

    def choose(self, d, truth):
        _, n, predicted = self.p.best_suffix(d, timed=True)
        self.st = HybridState(source="suffix", suffix_predicted=predicted, suffix_chain=(d.probs[:n], d.match))
        return n

    def update(self, n, accepted):
        self.p.after_verify(None, self.st, n, accepted, 0)


class Global:
    def __init__(self):
        self.predicted = self.accepted = 0.0
        self.cost = StepCost()

    def choose(self, d, truth):
        kappa = min(2.0, max(0.1, self.accepted / self.predicted)) if self.predicted > 1.0 else 1.0
        best, cum, self.last = (1.0, 0), 0.0, 0.0
        for n, p in enumerate(d.probs, 1):
            cum += p
            rate = (1 + kappa * cum) / self.cost.ratio(1 + n)
            if rate > best[0]:
                best, self.last = (rate, n), cum
        return best[1]

    def update(self, n, accepted):
        self.predicted = CALIB_DECAY * self.predicted + self.last
        self.accepted = CALIB_DECAY * self.accepted + accepted


class Oracle:
    def __init__(self):
        self.cost = StepCost()

    def choose(self, d, truth):
        n = 0
        while n < min(len(d.tokens), len(truth)) and d.tokens[n] == truth[n]:
            n += 1
        return n if (1 + n) / (forward_ms(1 + n) + args.rest_ms) > 1 / (forward_ms(1) + args.rest_ms) else 0

    def update(self, n, accepted):
        pass


class Plain:
    cost = StepCost()

    def choose(self, d, truth):
        return 0

    def update(self, n, accepted):
        pass


def replay(rule) -> dict:
    index = SuffixProposer()  # one engine's: the shared index sees the earlier turns' outputs
    speeds, steps, drafted, accepted = [], 0, 0, 0
    for t in turns:
        out, params = t["output"], SimpleNamespace(user=None, seed=None, greedy=True)
        req = SimpleNamespace(params=params, prompt_ids=t["prompt"], max_tokens=t["max_tokens"])
        st, pos, ms = SuffixState(), 1, 0.0  # the first token comes from the prefill
        while pos < len(out):
            req.output_ids = out[:pos]
            req.all_ids = t["prompt"] + req.output_ids
            req.num_tokens = len(req.all_ids)
            k = min(16, t["max_tokens"] - pos - 1)  # spec_max_tokens, within the draft room
            d = index.draft(req, st, k) if k > 0 else None
            n = rule.choose(d, out[pos:]) if d is not None and d.tokens else 0
            acc = 0
            while acc < n and pos + acc < len(out) and d.tokens[acc] == out[pos + acc]:
                acc += 1
            if n:
                rule.update(n, acc)
                steps, drafted, accepted = steps + 1, drafted + n, accepted + acc
            rule.cost.add(1 + n, forward_ms(1 + n) / 1e3)
            ms += forward_ms(1 + n) + args.rest_ms
            pos += 1 + acc
        req.output_ids = out
        index.finish(req)
        speeds.append((len(out) - 1) / ms * 1e3)
    return {"speed_p50_tok_s": round(statistics.median(speeds), 1), "speed_mean_tok_s": round(statistics.mean(speeds), 1),
            "verify_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted}


rows = {}
for name, rule in (("none", Plain()), ("global", Global()), ("shipped", Shipped()), ("oracle", Oracle())):
    rows[name] = replay(rule)
    print(name, rows[name], flush=True)
print("| rule | P50 tok/s | mean tok/s | verify steps | drafted | accepted |\n|---|---|---|---|---|---|")
for k, v in rows.items():
    print(f"| {k} | {v['speed_p50_tok_s']} | {v['speed_mean_tok_s']} | {v['verify_steps']} | {v['draft_tokens']} | "
          f"{v['accepted_tokens']} |")
path = os.path.join(os.path.dirname(__file__), "..", "results", "spec_policy_sim.json")
with open(path, "w") as f:
    json.dump({"forward_ms": table, "row_ms": args.row_ms, "rest_ms": args.rest_ms, "rules": rows}, f, indent=1)
print(f"wrote {path}")
