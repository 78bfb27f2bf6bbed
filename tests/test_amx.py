"""lowlat on AMX tiles. Attention (csrc/attention_amx.h; bf16 models, bf16 caches, AMX-BF16): close to the FMA path,
batch-invariant bit for bit, lossless under speculation with draft trees. GGUF-block GEMVs of several rows
(csrc/quant_amx.h; AMX-INT8): the VNNI kernel's bits for every stored format and row count."""
import numpy as np
import pytest
import torch

from lanner import LLM, SamplingParams
from lanner.cpu import cpu_flags
from lanner.plugins import Hardware
from lanner.plugins.lowlat import LowLatPlugin
from conftest import needs_avx512
from lanner.models import quant
from test_lowlat import tiny_model
from test_quant import _random_k_blocks, models, plugins  # noqa: F401 (fixtures)

pytestmark = [needs_avx512, pytest.mark.skipif(not {"amx_bf16", "amx_int8"} <= cpu_flags(),
                                               reason="needs a CPU with AMX-BF16 and AMX-INT8")]


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


def test_amx_gemv_has_the_vnni_bits(plugins):
    """Q4_K / Q5_K / Q6_K / Q4_1 / Q8_0 weights (u4, u5, u6 codes with Q6_K's 16-element units, s8) against 2-40 q8
    activation rows: every output of the AMX path (steps of >= 2 rows; over 16 rows, whole 16s on tiles and the
    rest on VNNI) equals the VNNI kernel's bit for bit, so a row's result does not depend on the step's rows."""
    plugin = plugins["q8"]  # (the bundled model's kernel: qlinear takes weights up to its width)
    kernel, ext = plugin._kernel, plugin.extension()
    n, k = 40, 512  # (40 rows: a partial group of 16)
    rng = np.random.default_rng(7)
    scales = lambda count: (rng.uniform(0.5, 2, (n, k // 32, count)) * 1e-3).astype(np.float16).view(np.uint8)  # noqa
    raw = {name: _random_k_blocks(name, n, k, 7) for name in ("Q4_K", "Q5_K", "Q6_K")}
    raw["Q4_1"] = np.concatenate([scales(2), rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)], 2)
    raw["Q8_0"] = np.concatenate([scales(1), rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)], 2)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    try:
        for name, blocks in raw.items():
            w = quant.interleave(quant.repack(blocks.reshape(n, -1), name, k))
            ext.set_amx_gemv_rows(0)
            want = kernel.qlinear(x, w, n, True)
            ext.set_amx_gemv_rows(2)
            for m in (2, 5, 16, 17, 40):
                assert torch.equal(kernel.qlinear(x[:m], w, n, True), want[:m]), (name, m)
    finally:
        ext.set_amx_gemv_rows(plugin.amx_gemv_rows)
