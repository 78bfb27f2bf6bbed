import pytest

from lanner import LLM


@pytest.fixture(scope="session")
def llm32():
    """The real default model in float32: greedy results must not depend on batching, which only float32 gives."""
    return LLM(dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="session")
def default_gguf():
    from lanner.models.loader import default_model_path

    return default_model_path()
