"""Hybrid speculation: per request and per step, the suffix draft (or a prefix of it), the draft head's, or none,
whichever is expected to emit the most tokens per unit of time. Without a head (a model none was trained for) it
is suffix drafting that verifies only the prefix whose expected tokens pay for its rows.

The suffix draft comes with each token's running probability under the index's frequencies (lanner.spec.suffix)
and the length of the context it matched. How likely the target is to accept each token after the ones before it is
learned on this engine from the suffix drafts it verified (Acceptance): per bucket of the index's frequency for that
token and of the match length, starting from the frequency itself. The running products of those chances, summed,
are the tokens a draft prefix expects to get accepted. (A tree draft: its score, scaled by accepted / predicted over
the trees verified lately.) It costs microseconds. The head's expectation for a draft of n tokens: the running
products of this request's chances that the target accepts the head's j-th token once it accepted the ones before
(running means per position, a prior until it has drafted), summed; a draft costs a head call, timed as a line in
its length.

Time is what a step costs in the rows it verifies: T(n) = a + b n, fitted over the recent decode and verify
forwards (StepCost). On a GPU a few more rows are nearly free; on lowlat's CPU path every row pays its share of the
matmuls and of the attention (the AVX2 q8 GEMV: 4 rows cost 2.8x one), so a draft pays only when its expected
acceptance beats that. With e_L the expected accepted tokens of the first L suffix tokens and H the head's drafting
time for n tokens, a step emits 1 / T(1) tokens per second plain, (1 + e_L) / T(1 + L) with the suffix prefix,
and (1 + h_n) / (T(1 + n) + H(n)) with the head's best length n; the largest wins. (On a small target a 4-row
verify costs about twice a decode step, so a head accepting ~0.4 at its first token pays at n = 1, not at 3.)
Until steps of several sizes have been timed the rows count as free and the head costs nothing (each option gets
its chance). A seeded sample decides
without the times: its drafts, and with them the verifier's random draws, must be a function of its prompt and seed
alone, not of the machine's load.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from lanner.spec.base import Draft, Proposer, draft_room
from lanner.spec.suffix import SuffixProposer, SuffixState

HEAD_PRIOR = (0.45, 0.35)  # the chance of the head's first token being accepted, and of each later one after an
# accepted one, before a request has drafted (the shipped heads: 0.35-0.47 at the first, ~0.33 after)
HEAD_DECAY = 0.7  # weight of the old mean per head step: recent text decides
TIME_DECAY = 0.9  # weight of the old mean of the head's drafting time
COST_DECAY = 0.97  # weight of the older steps in the step-time fit (per step)
CALIB_DECAY = 0.98  # weight of the older suffix tree verifications in accepted / predicted
MIN_STEPS = 8  # steps before the fit decides


class Acceptance:
    """The chance that the target accepts a suffix chain's next token once it accepted the ones before: per bucket of
    the index's conditional frequency for the token (its running probability over the previous one's) and of the
    draft's match length, decayed hits / tries over the verified tokens, with PRIOR pseudo-tries at the token's own
    frequency (an unseen bucket trusts the index). A token counts as tried when all before it were accepted.

    The index's frequencies alone overrate short matches: on the agent-session replay, of the tokens the index gave
    a conditional frequency of 0.8 or more, 24% / 44% / 84% / 94% / 91% were accepted after a match of 0-1 / 2-3 /
    4-5 / 6-7 / 8+ tokens (tools/spec_policy_sim.py; docs/speculation.md)."""

    FREQ_BUCKETS = 5
    MATCH_CAP, MATCH_WIDTH = 8, 2  # match buckets: [0, 2), [2, 4), [4, 6), [6, 8), 8+
    PRIOR = 4.0
    DECAY = 0.995  # weight of the older tries, per verified draft

    def __init__(self):
        self.hits: dict[tuple[int, int], float] = {}
        self.tries: dict[tuple[int, int], float] = {}

    def _keys(self, probs: list[float], match: int) -> list[tuple[tuple[int, int], float]]:
        m, out, prev = min(match, self.MATCH_CAP) // self.MATCH_WIDTH, [], 1.0
        for p in probs:
            q = p / prev if prev > 0 else 0.0
            prev = p
            out.append(((min(self.FREQ_BUCKETS - 1, int(q * self.FREQ_BUCKETS)), m), q))
        return out

    def expected(self, probs: list[float], match: int) -> list[float]:
        """Expected accepted tokens of each prefix (1, 2, .. tokens) of a chain with these running probabilities."""
        out, run, total = [], 1.0, 0.0
        for key, q in self._keys(probs, match):
            run *= (self.hits.get(key, 0.0) + self.PRIOR * q) / (self.tries.get(key, 0.0) + self.PRIOR)
            total += run
            out.append(total)
        return out

    def update(self, probs: list[float], match: int, accepted: int):
        """A verified chain (the drafted prefix's running probabilities) got its first `accepted` tokens accepted."""
        for key in self.tries:
            self.tries[key] *= self.DECAY
            self.hits[key] *= self.DECAY
        for i, (key, _) in enumerate(self._keys(probs[: accepted + 1], match)):
            self.tries[key] = self.tries.get(key, 0.0) + 1.0
            self.hits[key] = self.hits.get(key, 0.0) + (1.0 if i < accepted else 0.0)


class StepCost:
    """A decode / verify forward's seconds as a line in its rows, T(n) = a + b n: least squares over the recent steps
    (weights decaying per step)."""

    def __init__(self):
        self.s = [0.0] * 5  # decayed sums of 1, n, n^2, t, n t
        self.steps = 0
        self.line: tuple[float, float] | None = None  # (a, b), refitted at each step

    def add(self, rows: int, seconds: float):
        self.s = [COST_DECAY * x for x in self.s]
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.s[i] += v
        self.steps += 1
        self.line = self._fit()

    def _fit(self) -> tuple[float, float] | None:
        """(a, b), or None until enough steps of different row counts were seen (a plain decode step need not be
        among them: with every step drafting, the line through the verify steps gives T(1))."""
        if self.steps < MIN_STEPS:
            return None
        w, n, n2, t, nt = self.s
        var = w * n2 - n * n
        if var <= 1e-9 * w * w:
            return None
        b = (w * nt - n * t) / var
        a = (t - b * n) / w
        return (a, b) if a + b > 0 else None

    def ratio(self, rows: int) -> float:
        """T(rows) / T(1); 1 (free rows) before the fit. A verify never counts as cheaper than a decode."""
        if self.line is None:
            return 1.0
        a, b = self.line
        return max(1.0, (a + b * rows) / (a + b))

    def decode_s(self) -> float | None:
        return self.seconds(1)

    def seconds(self, rows: int) -> float | None:
        """T(rows), or None before the fit."""
        return None if self.line is None else max(0.0, self.line[0] + self.line[1] * rows)


@dataclass
class HybridState:
    """A request's suffix index, its head state, and which of them drafted its last step."""

    suffix: SuffixState = field(default_factory=SuffixState)
    head: object = None  # the head proposer's state
    source: str | None = None  # the proposer that drafted the request's last step
    head_rates: list[float] = field(default_factory=list)  # running P(head token j accepted | the ones before)
    suffix_predicted: float = 0.0  # accepted tokens the suffix draft of the last step was expected to get
    suffix_chain: tuple[list[float], int] | None = None  # that draft's running probabilities and match


class HybridProposer(Proposer):
    name = "hybrid"

    def __init__(self, suffix: SuffixProposer, head: Proposer | None, head_tokens: int):
        self.suffix, self.head, self.head_tokens = suffix, head, head_tokens
        self.cost = StepCost()
        self.head_s: float | None = None  # moving mean of a head drafting call's seconds
        self.head_time = StepCost()  # a head call's seconds as a line in its draft length
        self.acceptance = Acceptance()  # suffix chains
        self.predicted = self.accepted = 0.0  # decayed sums over suffix tree verifications: expected vs accepted

    def new_state(self):
        return HybridState(head=None if self.head is None else self.head.new_state())

    def restart(self, st, start):
        if self.head is not None:
            self.head.restart(st.head, start)

    def keep_features(self, st, rows):
        if self.head is not None:
            self.head.keep_features(st.head, rows)

    def source(self, st) -> str:
        return st.source or self.name

    def head_cost(self, n: int) -> float:
        """An n-token head draft's time relative to a decode step (0 until both were measured): the line through
        the timed calls, or their mean while they all drafted one length."""
        t1 = self.cost.decode_s()
        if t1 is None or self.head_s is None:
            return 0.0
        s = self.head_time.seconds(n)
        return (self.head_s if s is None else s) / t1

    def best_head(self, st, kh: int, timed: bool) -> tuple[float, int]:
        """(tokens per decode-step time, draft length) of the head's best draft of at most kh tokens."""
        best, run, expect = (0.0, 0), 1.0, 0.0
        for j in range(kh):
            run *= st.head_rates[j] if j < len(st.head_rates) else HEAD_PRIOR[min(j, 1)]
            expect += run
            rate = (1 + expect) / (self.cost.ratio(2 + j) + self.head_cost(j + 1)) if timed else 1 + expect
            if rate > best[0]:
                best = (rate, j + 1)
        return best

    def calibration(self) -> float:
        """Accepted / predicted tokens of the suffix trees verified lately (1 before any)."""
        return min(2.0, max(0.1, self.accepted / self.predicted)) if self.predicted > 1.0 else 1.0

    def best_suffix(self, d, timed: bool) -> tuple[float, int, float]:
        """(tokens per decode-step time, draft length, predicted accepted tokens) of the best prefix of draft d."""
        if not d.tokens:
            return 1.0, 0, 0.0
        if d.probs is None or not timed:  # a tree is verified whole; untimed (a seeded sample) rows count as free
            expect = self.calibration() * d.score if timed else d.score
            return (1 + expect) / (self.cost.ratio(1 + len(d.tokens)) if timed else 1.0), len(d.tokens), d.score
        best = (1.0, 0, 0.0)
        for n, expect in enumerate(self.acceptance.expected(d.probs, d.match), 1):
            rate = (1 + expect) / self.cost.ratio(1 + n)
            if rate > best[0]:
                best = (rate, n, expect)
        return best

    def propose(self, requests, ks, states):
        out: list = [None] * len(requests)
        to_head, head_len = [], 0
        for i, (r, k, st) in enumerate(zip(requests, ks, states)):
            d = self.suffix.draft(r, st.suffix, k)
            timed = r.params.seed is None or r.params.greedy
            rate, n, predicted = self.best_suffix(d, timed)
            kh = min(k, self.head_tokens, draft_room(r)) if self.head is not None else 0
            head_rate, n_head = self.best_head(st, kh, timed)
            if n_head > 0 and head_rate > rate:
                st.source = self.head.name
                to_head.append(i)
                head_len = max(head_len, n_head)  # one length for the step's head drafts: one fused call
            else:  # the suffix draft's best prefix (possibly empty: a plain decode step is the better bet)
                st.source, st.suffix_predicted = self.suffix.name, predicted
                st.suffix_chain = (d.probs[:n], d.match) if d.probs is not None else None
                out[i] = Draft(d.tokens[:n], parents=d.parents if n == len(d.tokens) else None)
        if to_head:
            # only steady-state calls are timed: a head catching up on a long stretch (a prompt, a run of suffix
            # drafts) pays that once, and one such sample must not lock the head out for good
            heads = [states[i].head for i in to_head]
            steady = all(h.features is None or h.features.shape[0] <= ks[i] + 1 for h, i in zip(heads, to_head))
            t0 = time.perf_counter()
            drafts = self.head.propose([requests[i] for i in to_head],
                                       [min(ks[i], head_len, draft_room(requests[i])) for i in to_head], heads)
            if steady:
                seconds = time.perf_counter() - t0
                self.head_s = _mean(self.head_s, seconds)
                self.head_time.add(head_len, seconds)
            for i, d in zip(to_head, drafts):
                out[i] = d
        return out

    def prepare(self, req, st):
        self.suffix.prepare(req, st.suffix)

    def after_step(self, seconds: float, rows: int):
        self.cost.add(rows, seconds)

    def after_verify(self, req, st, num_proposed, num_accepted, tokens_before):
        if st.source == self.suffix.name:
            if st.suffix_chain is not None:
                probs, match = st.suffix_chain
                self.acceptance.update(probs[:num_proposed], match, num_accepted)
            else:
                self.predicted = CALIB_DECAY * self.predicted + st.suffix_predicted
                self.accepted = CALIB_DECAY * self.accepted + num_accepted
            return
        if self.head is None or st.source != self.head.name:
            return
        self.head.after_verify(req, st.head, num_proposed, num_accepted, tokens_before)
        rates = st.head_rates
        for j in range(min(num_accepted + 1, num_proposed)):  # the positions tried: up to the first rejected one
            prev = rates[j] if j < len(rates) else HEAD_PRIOR[min(j, 1)]
            rate = HEAD_DECAY * prev + (1 - HEAD_DECAY) * (j < num_accepted)
            if j < len(rates):
                rates[j] = rate
            else:
                rates.append(rate)

    def finish(self, req, st, completed):
        if self.head is not None:
            self.head.finish(req, st.head, completed)
        self.suffix.finish(req, st.suffix, completed)

    def forget(self):
        self.suffix.forget()


def _mean(old: float | None, new: float) -> float:
    return new if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * new
