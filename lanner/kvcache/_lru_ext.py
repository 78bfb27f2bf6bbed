"""Compiles (once per source version) and loads the C++ loops of lanner.kvcache.lru (csrc/lru.cpp)."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("lanner")
SOURCE = Path(__file__).resolve().parent / "csrc" / "lru.cpp"
_state: dict = {}


def load():
    """The extension module, or None where it cannot be built (no C++ compiler): the policies then run their
    PyTorch ops. Built with torch.utils.cpp_extension into torch's extension cache (~/.cache/torch_extensions)."""
    if "module" not in _state:
        import subprocess
        import time

        try:
            from torch.utils.cpp_extension import load as cpp_load

            t0 = time.perf_counter()  # the first build takes ~15 s, later loads come from the cache
            _state["module"] = cpp_load(name="lanner_kvcache_lru", sources=[str(SOURCE)], extra_cflags=["-O3"])
            log.info("kvcache: C++ replacement loops ready in %.1fs", time.perf_counter() - t0)
        except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
            # a missing compiler is not an error: the PyTorch path computes the same
            log.warning("kvcache: C++ replacement loops unavailable (%s: %s); using PyTorch ops",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _state["module"] = None
    return _state["module"]
