import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from lanner import LLM

# tests that take over ~5 s each on the 2-core CI machine (model loads and compiles included), by node id without
# parameters: `pytest -m "not slow"` runs the rest (README). Regenerate from `pytest --durations=0` output.
SLOW = set(Path(__file__).with_name("slow_tests.txt").read_text().split())


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def llm32():
    """The real default model in float32: greedy results must not depend on batching, which only float32 gives."""
    return LLM(dtype="float32", weights="dequantize", max_num_seqs=16)


@pytest.fixture(scope="session")
def default_gguf():
    from lanner.models.loader import default_model_path

    return default_model_path()


@contextlib.contextmanager
def serve(app):
    """Runs `app` with uvicorn on 127.0.0.1 and a free port in a background thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama (4 query / 2 KV heads, vocab 256) with fan-in-scaled random weights: logits far apart, so
    greedy choices do not hinge on rounding."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny-llama")
    h, inter, layers, heads, kv, vocab, d = 64, 128, 2, 4, 2, 256, 16
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "eos_token_id": 1}
    gen = torch.Generator().manual_seed(0)
    w = lambda *shape: torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen), "model.norm.weight": torch.ones(h),
               "lm_head.weight": w(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                    p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h),
                    p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@contextlib.contextmanager
def openai_server(**engine_options):
    """A real server over a fresh float32 engine of the bundled model; yields (base URL, AsyncEngine, an official
    openai client without retries)."""
    import openai

    from lanner.config import EngineConfig
    from lanner.engine.async_engine import AsyncEngine
    from lanner.engine.llm_engine import LLMEngine
    from lanner.server.app import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", **engine_options)))
    try:
        with serve(build_app(engine)) as base:
            yield base, engine, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
    finally:
        engine.shutdown()


def _lowlat_marks():
    from lanner.cpu import cpu_flags
    from lanner.plugins.lowlat import cpu_variant

    variant = cpu_variant(cpu_flags())
    return (pytest.mark.skipif(variant is None, reason="lowlat needs AVX-512F or AVX2 + FMA + F16C"),
            pytest.mark.skipif(variant != "avx512", reason="compares lowlat's AVX-512 build: needs an AVX-512F CPU"))


# needs_lowlat: the plugin runs here (its AVX2 build on an AVX2-only CPU); needs_avx512: the test asks for the
# AVX-512 build itself (isa="avx512f", or the AVX2 build's bits against it)
needs_lowlat, needs_avx512 = _lowlat_marks()
