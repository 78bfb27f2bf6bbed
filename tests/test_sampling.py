"""The sampler's math on small explicit distributions."""
import torch
from scipy.stats import chisquare

from lanner.engine.sampling import (
    SamplingParams,
    apply_penalties,
    processed_probs,
    sample_from_probs,
)


def test_exponential_race_sampling_matches_the_distribution():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(16) * 1.5, -1)
    n = 20000
    draws = sample_from_probs(probs.expand(n, 16).contiguous(), [None] * n)
    counts = torch.bincount(draws, minlength=16).double()
    expected = probs.double() / probs.double().sum() * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 0.001


def test_seeded_rows_use_their_own_generator():
    probs = torch.full((3, 100), 0.01)
    a = sample_from_probs(probs, [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)])
    b = sample_from_probs(probs, [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)])
    assert a[0] == b[0] and a[2] == b[2]


def test_top_k_top_p_min_p_and_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=0.7)])  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))
    p = processed_probs(logits, [SamplingParams(temperature=1.0, min_p=0.4)])  # keeps p >= 0.4 * 0.5
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0, 0]]) / 0.75)
    p = processed_probs(logits, [SamplingParams(temperature=0.5)])
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    # rows keep their own settings in one batch
    p = processed_probs(logits.repeat(2, 1), [SamplingParams(top_k=1), SamplingParams()])
    assert torch.allclose(p[0], torch.tensor([1.0, 0, 0, 0])) and torch.allclose(p[1], logits.exp()[0])


def test_penalties_exact_values():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert torch.allclose(out, torch.tensor([1.0, -4.0, 1.0, 0.5]))
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3], [2, 2, 0])
    assert torch.allclose(out, torch.tensor([2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]))


def test_logit_bias_and_python_api_bounds():
    import pytest

    from lanner.engine.request import Request
    from lanner.engine.sampling import sample

    def pick(params):
        return sample(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), [Request("r", [0], params, None, 4, [])]).token_ids

    assert pick(SamplingParams(temperature=0, logit_bias={3: 100})) == [3]  # +100 forces a token
    assert pick(SamplingParams(temperature=0, logit_bias={0: -100})) == [1]  # -100 bans one
    assert pick(SamplingParams(temperature=0.5, seed=1, logit_bias={0: -100, 1: -100, 2: -100})) == [3]
    for bad in ({"seed": 2**64}, {"seed": -(2**63) - 1}, {"temperature": float("nan")},
                {"repetition_penalty": float("inf")}, {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
