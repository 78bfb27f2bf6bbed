import contextlib
import threading
import time

import pytest
import uvicorn

from lanner import LLM


@pytest.fixture(scope="session")
def llm32():
    """The real default model in float32: greedy results must not depend on batching, which only float32 gives."""
    return LLM(dtype="float32", max_num_seqs=16)


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
