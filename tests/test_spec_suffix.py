"""Suffix and hybrid speculation: the suffix index's drafts, the shared index's scoping and eviction, option
errors, and losslessness on the real model (greedy, float32: token-identical to plain decoding at batch 1, in
mixed batches of 4 and with prefix-cache hits)."""
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lanner import LLM, SamplingParams
from lanner.cli import build_parser, engine_kwargs
from lanner.config import EngineConfig
from lanner.engine.sampling import processed_probs
from lanner.spec.hybrid import HybridProposer, HybridState, StepCost
from lanner.spec.suffix import SuffixProposer, SuffixState, extension, scope_of, step_cost_ms
from lanner.spec.verify import verify_tree
from lanner.spec.base import first_path

PROMPTS = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# Now a loop version:\n",
    "Hi",
    "List the planets of the solar system in order.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Req:
    """The fields of lanner.engine.request.Request the proposer reads."""

    def __init__(self, ids, user=None, prompt_len=None):
        self.all_ids = list(ids)
        self.prompt_ids = self.all_ids[: prompt_len if prompt_len is not None else len(ids)]
        self.output_ids = self.all_ids[len(self.prompt_ids):]
        self.params = SamplingParams(user=user)

    @property
    def num_tokens(self):
        return len(self.all_ids)


def test_index_drafts_the_most_frequent_continuation_up_to_the_match_length():
    index = extension().SuffixIndex(8)
    index.extend([7, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    tokens, match, score, probs = index.draft_own(16, 1.0, 0.0)
    # the longest earlier context of the tail is "1 2 3" (then 9 twice, 4 once); at most 3 tokens for a 3-match
    assert (tokens, match) == ([9, 1, 2], 3) and abs(score - 3 * 2 / 3) < 1e-9
    assert probs == pytest.approx([2 / 3] * 3)  # each token's running probability
    assert index.draft_own(1, 1.0, 0.0)[0] == [9]
    index.extend([6])  # "1 2 3 6" never occurred: no context ending in 6 has a continuation beyond one token
    assert index.draft_own(16, 1.0, 0.0)[0] == []
    # min_prob cuts the draft where its running probability drops below it
    index = extension().SuffixIndex(8)
    index.extend([5, 1, 2, 5, 1, 3, 5, 1, 4, 5])
    assert index.draft_own(4, 4.0, 0.0)[0][0] == 1
    assert len(index.draft_own(4, 4.0, 0.5)[0]) == 1  # "5 -> 1" is certain, then 2 / 3 / 4 each 1/3


def test_shared_index_is_scoped_by_user_and_evicts_oldest_first():
    proposer = SuffixProposer(depth=8, shared_tokens=30)
    text = list(range(100, 120))
    proposer.finish(Req([1, 2, 3] + text, user="alice", prompt_len=3))

    def draft(req, k):
        return proposer.draft(req, SuffixState(), k).tokens

    query = [50, 51] + text[:6]  # the request's own text never saw this continuation
    assert draft(Req(query, user="alice"), 8) == text[6:12]  # as long as the 6-token match
    assert draft(Req(query, user="bob"), 8) == []  # another user's outputs never draft
    assert draft(Req(query), 8) == []
    proposer.finish(Req([4] + list(range(200, 220)), user="bob", prompt_len=1))  # 40 tokens > 30: alice's leaves
    assert proposer.stored_tokens == 20 and draft(Req(query, user="alice"), 8) == []
    assert draft(Req([9] + list(range(200, 205)), user="bob"), 4) == [205, 206, 207, 208]
    proposer.forget()  # benchmarks between levels: nothing learned across requests is left
    assert proposer.stored_tokens == 0 and draft(Req([9] + list(range(200, 205)), user="bob"), 4) == []


def test_index_drafts_a_tree_best_first():
    # after "1 2": 3 (x3) or 4 (x1); after "2 3": 9 (x2) or 5 (x1)
    index = extension().SuffixIndex(8)
    index.extend([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 5, 1, 2])
    tokens, parents, match, score = index.draft_tree_own(4, 2, 1.0, 0.0)
    assert match == 2 and tokens[0] == 3 and parents[0] == -1  # the best first: "3" (3 / 4)
    paths = {tuple(tokens[j] for j in chain(i, parents)) for i in range(len(tokens))}
    assert paths >= {(3,), (4,), (3, 9)} and len(tokens) == 4 and max(map(len, paths)) <= 2
    assert score == pytest.approx(sum(probability(p) for p in paths))
    # a chain is the tree's first path
    assert first_path(tokens, parents) == index.draft_own(2, 1.0, 0.0)[0] == [3, 9]


def chain(i, parents):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def probability(path):
    p = {(3,): 3 / 4, (4,): 1 / 4, (3, 9): 3 / 4 * 2 / 3, (3, 5): 3 / 4 * 1 / 3, (4, 7): 1 / 4}
    return p[path]


def test_tree_verification_samples_the_target_distribution():
    """Sampled tree verify with 3 candidates at the root and 2 under the first: the first emitted token follows
    p(root row) and the second, after the first candidate was accepted, p(its row) (chi-square, 20,000 draws);
    greedy follows the argmax path."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=g) * 1.5
    tokens, parents = [2, 5, 1, 3, 0], [-1, -1, -1, 0, 0]  # node 0 (token 2) has children 3 and 0
    params = SamplingParams(temperature=0.8, top_p=1.0)
    probs = processed_probs(logits, [params] * 6)
    firsts, seconds = np.zeros(8), np.zeros(8)
    for _ in range(20000):
        out, path = verify_tree(logits, tokens, parents, params, g)
        assert out[: len(path)] == [tokens[i] for i in path]
        firsts[out[0]] += 1
        if path[:1] == [0]:
            seconds[out[1]] += 1
    for counts, row in ((firsts, 0), (seconds, 1)):
        expected = probs[row].double().numpy()
        assert chisquare(counts, expected / expected.sum() * counts.sum()).pvalue > 0.001
    greedy = logits.clone()
    greedy[0, 2], greedy[1, 0] = 99, 99  # the target's argmax: token 2 (node 0), then token 0 (node 4)
    assert verify_tree(greedy, tokens, parents, SamplingParams(temperature=0), None) == \
        ([2, 0, int(greedy[5].argmax())], [0, 4])


def test_step_cost_is_measured_at_an_8k_context():
    ms = step_cost_ms(list(range(1000)) * 3, steps=50)
    assert 0 < ms < 50  # sanity only: the benchmark prints the figure, tests do not time


def test_options_are_validated_and_the_cli_passes_them():
    for bad in (0, 33, 2.0):
        with pytest.raises(ValueError, match="spec_max_tokens"):
            EngineConfig(spec="suffix", spec_max_tokens=bad)
    with pytest.raises(ValueError, match="spec"):
        EngineConfig(spec="tree")
    for bad in ({"spec_tree": 33}, {"spec_tree": -1}, {"spec_tree": 8, "spec": "ngram"},
                {"spec_tree": 8, "spec": "suffix", "kv_tier": "ula-dp"}):
        with pytest.raises(ValueError, match="spec_tree"):
            EngineConfig(**bad)
    assert EngineConfig(spec="suffix", spec_tree=12).draft_limit == 12
    assert (EngineConfig().spec, EngineConfig().draft) == ("hybrid", "default")
    assert EngineConfig(spec="suffix", spec_max_tokens=24).draft_limit == 24
    kw = engine_kwargs(build_parser().parse_args(["generate", "x", "--spec", "suffix", "--spec-max-tokens", "8",
                                                  "--spec-tree", "6"]))
    assert (kw["spec"], kw["spec_max_tokens"], kw["spec_tree"]) == ("suffix", 8, 6)
    with pytest.raises(ValueError, match="user"):
        SamplingParams(user=3)


@pytest.fixture(scope="module")
def plain(llm32):
    outs = llm32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("spec", ["suffix-tree", "hybrid"])  # hybrid's suffix drafts are chains
def test_greedy_is_lossless_alone_batched_and_with_prefix_hits(spec, llm32, plain):
    llm = llm32 if spec == "hybrid" else LLM(dtype="float32", weights="dequantize", spec="suffix", max_num_seqs=16,
                                             spec_tree=12 if spec == "suffix-tree" else 0)
    assert isinstance(llm.engine.proposer, HybridProposer if spec == "hybrid" else SuffixProposer)
    verified = []  # the trees verification saw: some must branch (the code prompt's "fib(n - 1)" / "fib(n - 2)")
    if spec == "suffix-tree":
        verify = llm.engine.spec.verify
        llm.engine.spec.verify = lambda it, logits: verified.append(it.draft.parents) or verify(it, logits)
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in alone] == plain
    # a mixed batch of 4 (one opts out), the prompts now in the prefix cache and the outputs in the shared index
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False),
              GREEDY]
    batch = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in batch] == plain
    assert all(o.metrics["cached_prompt_tokens"] > 0 for o in batch if o.metrics["prompt_tokens"] >= 32)
    assert batch[2].metrics["spec_verify_steps"] == 0
    drafted = [o.metrics["spec_draft_tokens"] for o in alone + batch]
    accepted = sum(sum(o.metrics["spec_accepted_tokens"].values()) for o in alone + batch)
    assert any("suffix" in d for d in drafted) and accepted > 0
    # a repetition the suffix index predicts: several tokens per step
    assert batch[0].metrics["spec_accept_length"] > 2.0
    assert llm.engine.kv.block_manager.num_used == 0
    if spec == "suffix-tree":
        assert any(parents is not None and len(set(parents)) < len(parents) for parents in verified)

    if spec == "hybrid":  # cost-aware: the times are measured as it runs; a head too slow to pay never drafts, a
        p = llm.engine.proposer  # free one (on free rows) drafts where the suffix index has little (fresh prompts)
        assert p.cost.decode_s() > 0 and p.cost.ratio(4) >= 1.0
        fresh = {"slow": ["Name three rivers in Africa.", "Write a haiku about snow."],
                 "free": ["List two uses of copper.", "Describe a lighthouse in one sentence."]}
        seeded = SamplingParams(temperature=0.9, max_tokens=16, seed=7, ignore_eos=True)
        saved, runs, samples = (p.head_s, p.head_time, p.cost), {}, {}
        try:
            for name, head_s in (("slow", 1e6 * p.cost.decode_s()), ("free", 0.0)):
                p.head_s, p.head_time = head_s, StepCost()  # one mean time for any length
                if name == "free":
                    p.cost = StepCost()  # not fitted: rows count as free
                runs[name] = llm.generate(fresh[name], GREEDY)
                samples[name] = llm.generate(fresh["slow"][0], seeded)[0].token_ids
        finally:
            p.head_s, p.head_time, p.cost = saved
        assert samples["slow"] == samples["free"]  # a seed reproduces its text whatever the machine's timings
        assert not any(p.head.name in o.metrics["spec_draft_tokens"] for o in runs["slow"])
        assert any(p.head.name in o.metrics["spec_draft_tokens"] for o in runs["free"])
        off = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False)
        for name, outs in runs.items():
            assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(fresh[name], off)]


def test_prompt_is_indexed_in_its_prefill_step(llm32):
    """The request's own suffix index covers its prompt once the step that prefills it has run, before any decode
    step (a long prompt's indexing is prompt work, not a first decode step ms longer); a request that may not
    draft gets none."""
    eng = llm32.engine
    ids = llm32.tokenizer.encode("Count: " + " ".join(str(i) for i in range(120)))
    may = eng.add_request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=4))
    opted_out = eng.add_request(prompt_ids=ids[:-1], params=SamplingParams(temperature=0, max_tokens=4,
                                                                           speculative=False))
    eng.step()
    assert len(may.output_ids) == 1 and eng.spec.states[may.request_id].suffix.index.length() == len(ids)
    assert opted_out.request_id not in eng.spec.states or eng.spec.states[opted_out.request_id].suffix.index is None
    while eng.has_unfinished():
        eng.step()


def test_hybrid_drafts_the_prefix_that_pays_for_its_rows():
    """A step's time as a line in its rows (decayed least squares over decode and verify steps); the suffix draft is
    cut where one more row costs more than its expected acceptance brings, learned per match length from how the
    verified suffix drafts fared."""
    from lanner.spec.suffix import SuffixDraft as Draft

    cost = StepCost()
    for _ in range(4):
        cost.add(1, 1.0)
        cost.add(3, 1.5)  # T(n) = 0.75 + 0.25 n
    assert cost.ratio(1) == pytest.approx(1.0) and cost.ratio(4) == pytest.approx(1.75)
    p = HybridProposer(suffix=SuffixProposer(), head=None, head_tokens=3)  # best_suffix needs no head
    p.cost = cost
    draft = Draft([5, 6, 7], 1.6, probs=[0.9, 0.5, 0.2], match=2)
    # nothing verified yet: the index's frequencies; (1 + e_L) / ratio(1 + L): 1.52, 1.60, 1.49 -> two tokens
    assert p.best_suffix(draft, timed=True)[:2] == (pytest.approx(2.4 / 1.5), 2)
    long_match = Draft([5, 6, 7], 1.6, probs=[0.9, 0.5, 0.2], match=12)
    for _ in range(40):  # drafts on a 2-token match were rejected at their first token, on a 12-token one accepted
        p.after_verify(None, HybridState(source="suffix", suffix_chain=(draft.probs[:2], 2)), 2, 0, 0)
        p.after_verify(None, HybridState(source="suffix", suffix_chain=(long_match.probs, 12)), 3, 3, 0)
    assert p.best_suffix(draft, timed=True)[1] == 0  # no draft pays on a short match
    assert p.best_suffix(long_match, timed=True)[1] == 3  # a long one now expects more than the frequencies said
    assert p.best_suffix(draft, timed=False)[1] == 3  # a seeded sample: the whole draft, whatever the times
    for _ in range(200):
        cost.add(1, 1.0)
        cost.add(3, 3.0)  # now every row costs a decode step
    assert cost.ratio(4) == pytest.approx(4.0, rel=1e-3)


def test_hybrid_head_drafts_the_length_that_pays():
    """The head's draft length is chosen like the suffix prefix: its expected accepted tokens (this request's running
    chance per position, a prior before any) against the verify rows and the head call's time, lines in the length."""
    from lanner.spec.base import Proposer

    cost = StepCost()
    for _ in range(4):
        cost.add(1, 1.0)
        cost.add(3, 1.5)  # T(n) = 0.75 + 0.25 n
    p = HybridProposer(suffix=SuffixProposer(), head=Proposer(), head_tokens=3)
    p.cost, st = cost, HybridState()
    # the prior: e = 0.45, 0.6075, 0.663 over ratio(2, 3, 4) = 1.25, 1.5, 1.75 -> one token pays best
    assert p.best_head(st, 3, timed=True) == (pytest.approx(1.45 / 1.25), 1)
    assert p.best_head(st, 3, timed=False)[1] == 3  # a seeded sample: the longest draft, whatever the times
    p.head_s = 0.5  # timed at one length only: every length costs that mean
    assert p.head_cost(1) == p.head_cost(3) == pytest.approx(0.5)
    assert p.best_head(st, 3, timed=True) == (pytest.approx(1.45 / 1.75), 1)  # < 1: slower than a plain step
    for n in (1, 3, 1, 3, 1, 3, 1, 3):
        p.head_time.add(n, 0.1 * n)  # two lengths timed: the line, 0.1 decode steps a token
    assert p.head_cost(2) == pytest.approx(0.2)
    assert p.best_head(st, 3, timed=True) == (pytest.approx(1.45 / 1.35), 1)
    for _ in range(20):  # on this request the head's drafts are accepted whole
        p.after_verify(None, HybridState(source=p.head.name, head_rates=st.head_rates), 3, 3, 0)
    assert all(r > 0.99 for r in st.head_rates) and len(st.head_rates) == 3
    assert p.best_head(st, 3, timed=True)[1] == 3
    for _ in range(20):  # then its first token is rejected: the later positions are not tried, so they keep theirs
        p.after_verify(None, HybridState(source=p.head.name, head_rates=st.head_rates), 3, 0, 0)
    assert st.head_rates[0] < 0.01 and st.head_rates[2] > 0.99
    assert p.best_head(st, 3, timed=True)[0] < 1.0  # worse than a plain step: the suffix draft (or none) wins


def test_server_passes_user_and_reports_drafts_per_proposer():
    import httpx
    import openai
    from conftest import serve

    from lanner.engine.async_engine import AsyncEngine
    from lanner.engine.llm_engine import LLMEngine
    from lanner.server.app import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", spec="suffix")))
    try:
        with serve(build_app(engine)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            ask = dict(model=engine.model_name, max_tokens=24, temperature=0,
                       messages=[{"role": "user", "content": PROMPTS[0]}])
            first = client.chat.completions.create(user="alice", **ask).usage.model_dump()
            assert first["spec_draft_tokens"]["suffix"] > 0
            assert 0 < first["spec_accepted_tokens"]["suffix"] <= first["spec_draft_tokens"]["suffix"]
            shared = engine.engine.proposer
            text = httpx.get(f"{url}/metrics").text
            drafted = float(re.search(r'^lanner_spec_proposer_draft_tokens_total\{proposer="suffix"\} (\S+)', text,
                                      re.MULTILINE).group(1))
            assert drafted == first["spec_draft_tokens"]["suffix"]
            assert 'lanner_spec_proposer_accepted_tokens_total{proposer="suffix"}' in text
            # alice's finished output joined the shared index under her scope
            assert [d[2] for d in shared.documents] == [scope_of("alice")]
    finally:
        engine.shutdown()
