"""Models by name (lanner.models.catalog): a GGUF assembled once from its PyPI part packages, checked by size and
sha256, with errors that name a missing or truncated part; and the real Qwen2.5-Coder-1.5B served by its name."""
import hashlib
import importlib
import os

import pytest

from lanner.models.catalog import CATALOG, PartedModel, assemble

QWEN = CATALOG["qwen2.5-coder-1.5b"]
HAVE_QWEN = importlib.util.find_spec(QWEN.module(1)) is not None


def fake_model(root, contents: list[bytes]) -> PartedModel:
    """Part packages fake_part1.. under root (importable once root is on sys.path), each data/partNN.bin."""
    for i, data in enumerate(contents, 1):
        pkg = root / f"fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    importlib.invalidate_caches()
    whole = b"".join(contents)
    return PartedModel("fake", "Fake", "fake.gguf", "fake-part{i}", "1.0", len(contents), len(contents[0]),
                       len(whole), hashlib.sha256(whole).hexdigest(), "model-fake")


def test_assembles_once_and_names_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("LANNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = [os.urandom(1000), os.urandom(1000), os.urandom(300)]
    model = fake_model(tmp_path / "site", parts)
    path = assemble(model, progress=False)
    assert open(path, "rb").read() == b"".join(parts)
    mtime = os.stat(path).st_mtime_ns
    assert assemble(model, progress=False) == path and os.stat(path).st_mtime_ns == mtime  # reused, not rebuilt

    os.remove(path)
    part3 = tmp_path / "site" / "fake_part3" / "data" / "part03.bin"
    part3.write_bytes(parts[2][:200])
    with pytest.raises(ValueError, match=r"part 3 .* is 200 bytes, not 300: truncated.*fake-part3==1.0"):
        assemble(model, progress=False)
    part3.write_bytes(bytes(300))  # the right size, other bytes
    with pytest.raises(ValueError, match="sha256"):
        assemble(model, progress=False)
    assert os.listdir(tmp_path / "cache" / "models") == ["fake.gguf.sha256"]  # no partial or damaged file left
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"part 2 of 3 \(fake-part2==1.0\) is not installed.*make model-fake"):
        assemble(model, progress=False)


@pytest.mark.skipif(not HAVE_QWEN, reason="needs the Qwen2.5-Coder-1.5B parts (make model-qwen; make test installs them)")
def test_qwen_coder_by_name():
    """The real 1.5B coding model, by name: assembled from its 22 parts (sha256 checked), every GGUF tensor kept as
    stored (Q4_K, and Q6_K also inside fused q|k|v) within 10% of the file's tensor bytes, and it writes code. Its
    default speculation is the hybrid without a head (cost-aware suffix drafts), and greedy output equals plain
    decoding."""
    from gguf import GGUFReader

    from lanner import LLM, SamplingParams
    from lanner.models.loader import ModelSource
    from lanner.models.quant import QuantLinear

    source = ModelSource.resolve("qwen2.5-coder-1.5b")
    assert (source.kind, source.name, os.path.getsize(source.path)) == ("gguf", QWEN.served_name, QWEN.size)
    reader = GGUFReader(source.path)
    name = reader.fields["general.name"]
    assert bytes(name.parts[name.data[0]]).decode() == "Qwen2.5 Coder 1.5B Instruct GGUF"
    llm = LLM(model="qwen2.5-coder-1.5b", max_model_len=1024)
    eng = llm.engine
    assert eng.weights == "stored" and eng.model_name == QWEN.served_name
    assert (eng.config.spec, eng.config.draft, eng.proposer.head) == ("hybrid", None, None)  # suffix drafts
    assert eng.plugins.plugins[0].act == "q8"  # act="auto" from 1B parameters
    big = [n for n, p in eng.model.named_parameters() if p.numel() > 1 << 16]
    assert not big, big  # every matrix in its blocks: no dense weight left
    assert any(m.fmt == "u6k" for m in eng.model.layers[0].self_attn.qkv_proj.modules() if isinstance(m, QuantLinear))
    rope = sum(t.numel() * t.element_size() for t in eng.model.rotary.buffers())
    assert eng.weight_bytes - rope <= 1.1 * sum(int(t.n_bytes) for t in reader.tensors)
    asks = [[{"role": "user", "content": "Write a Python function that returns the nth Fibonacci number."}],
            [{"role": "user", "content": "Add type hints to this function and return it whole:\n```python\n"
                                         "def scale(values, factor):\n    result = []\n    for v in values:\n"
                                         "        result.append(v * factor)\n    return result\n```"}]]
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.chat(asks, params)
    assert outs[0].text.startswith("```python\ndef fibonacci(n):"), outs[0].text
    assert sum(sum(o.metrics["spec_accepted_tokens"].values()) for o in outs) > 0
    llm.close()
    plain = LLM(model="qwen2.5-coder-1.5b", max_model_len=1024, spec="none")
    assert [o.token_ids for o in plain.chat(asks, params)] == [o.token_ids for o in outs]
    plain.close()


def test_synthetic_llama_gguf_loads_and_generates(tmp_path):
    """A synthetic geometry's float16 GGUF (what llama.cpp's quantizer then takes): Llama tensors of the asked
    shapes with a real model's tokenizer (the bundled one: the synthetic sizes take Qwen2.5's, slower to load),
    norms in float32, and Lanner loads and runs it with that geometry."""
    import gguf

    from lanner import LLM, SamplingParams
    from lanner.models.loader import default_model_path
    from lanner.models.synthetic import write_f16

    geo = dict(layers=2, hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, tied=False)
    path = str(tmp_path / "tiny-f16.gguf")
    write_f16(path, geo, tokenizer_from=default_model_path())
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(tensors) == 1 + 9 * 2 + 2 and tuple(tensors["blk.1.attn_k.weight"].shape) == (64, 32)
    assert tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    llm = LLM(model=path, dtype="float32", spec=None, kv_cache_memory="0.05GiB", max_model_len=256)
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 49152)
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
