"""lowlat's attention on AMX tiles (csrc/attention_amx.h; bf16 models, bf16 caches, CPUs with AMX-BF16): close to
the FMA path, batch-invariant bit for bit, and lossless under speculation with draft trees."""
import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.cpu import cpu_flags
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_avx512
from test_lowlat import tiny_model

pytestmark = [needs_avx512, pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="needs a CPU with AMX-BF16")]


def kernel_for(heads, kv_heads, head_dim):
    model = tiny_model(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       hidden_size=heads * head_dim).to(torch.bfloat16)
    plugin = LowLatPlugin(threads=1)
    hw = Hardware.detect("cpu", torch.bfloat16)
    plugin.check(model.cfg, hw)
    plugin.build(model, model.cfg, hw)
    assert plugin._kernel.attn_amx  # the plugin turns it on where the CPU has it
    return plugin._kernel


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 3, 64), (12, 2, 128)])
def test_amx_attention_is_close_to_the_fma_path_and_batch_invariant(heads, kv_heads, head_dim):
    """Batched sequences (decode rows, verify runs of 5 and 17 rows, 530 and 600 keys: two 512-key blocks, partial
    tiles) over scattered blocks: within bf16 rounding of the FMA path (nearly all elements identical), and every
    row's bits equal those of the same row decoded alone at its position."""
    kernel = kernel_for(heads, kv_heads, head_dim)
    H, D, bs = heads, head_dim, 16
    torch.manual_seed(0)
    kc, vc = torch.randn(80 * bs, kv_heads, D).bfloat16(), torch.randn(80 * bs, kv_heads, D).bfloat16()
    q_lens, ctx_lens = [1, 5, 3, 17], [1, 600, 45, 530]
    tables = [[70], list(range(40, 78)), [9, 3, 30], list(range(34))]
    q = torch.randn(sum(q_lens), H * D).bfloat16()
    pos = torch.tensor([c - n + i for n, c in zip(q_lens, ctx_lens) for i in range(n)])
    out = {}
    for amx in (False, True):
        kernel.attn_amx = amx
        out[amx] = kernel.attention(q, kc, vc, pos, q_lens, ctx_lens, tables, bs).float()
    diff = (out[True] - out[False]).abs()
    assert diff.max() < 2e-3 and (diff == 0).float().mean() > 0.99
    assert out[True].abs().sum() > 0
    t = 0
    for b, (n, c) in enumerate(zip(q_lens, ctx_lens)):
        for i in range(n):
            alone = kernel.attention(q[t + i:t + i + 1], kc, vc, pos[t + i:t + i + 1], [1], [c - n + i + 1],
                                     [tables[b]], bs).float()
            assert torch.equal(alone, out[True][t + i:t + i + 1]), (b, i)
        t += n


def test_bf16_tree_speculation_is_lossless_on_amx():
    """The default bf16 model (head_dim 64) with suffix-draft trees: tree rows read their ancestors through
    per-row tiles, and greedy output equals plain decoding, alone and batched."""
    llm = LLM(dtype="bfloat16", plugin="lowlat", spec="suffix", spec_tree=12, kv_cache_memory="0.25GiB")
    assert llm.engine.plugins.plugins[0].kernel.attn_amx
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
               "# Now a loop version:\n", "Repeat exactly: red, green, blue, red, green, blue, red, green"]
    trees = []
    verify = llm.engine.spec.verify
    llm.engine.spec.verify = lambda it, logits: trees.append(it.draft.parents) or verify(it, logits)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [llm.generate(p, greedy)[0].token_ids for p in prompts]  # first: the suffix index has not seen the text
    batch = [o.token_ids for o in llm.generate(prompts, greedy)]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False)
    assert alone == batch == [llm.generate(p, plain)[0].token_ids for p in prompts]
    assert any(p is not None and len(set(p)) < len(p) for p in trees)  # trees that branch were verified
    assert llm.engine.plugins.counts.get(("lowlat", "verify"), 0) > 5
