"""Compiles (once per machine and source version) and loads the lowlat C++ extension."""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("lanner")
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "lowlat.cpp"]
HEADERS = [CSRC / "quant.h"]  # included by lowlat.cpp: their hash goes into the flags so an edit rebuilds
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_module = None
compile_seconds: float | None = None  # wall time of the load() that built or found the extension


def _cpu_key() -> str:
    """-march=native code is only valid on the CPU it was built for: the cache name carries the CPU's identity."""
    from lanner.plugins.base import _cpu_flags, _cpu_name

    return hashlib.sha1((_cpu_name() + " ".join(sorted(_cpu_flags()))).encode()).hexdigest()[:8]


def load():
    """The extension module (compiled with torch.utils.cpp_extension.load into torch's extension cache,
    ~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR; rebuilt only when the sources change)."""
    global _module, compile_seconds
    if _module is None:
        from torch.utils.cpp_extension import load as cpp_load

        t0 = time.perf_counter()
        headers = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:12]
        _module = cpp_load(name=f"lanner_lowlat_{_cpu_key()}", sources=[str(s) for s in SOURCES],
                           extra_cflags=[*CFLAGS, f"-DLOWLAT_HEADERS={headers}"], extra_ldflags=["-fopenmp"],
                           verbose=os.environ.get("LANNER_LOWLAT_VERBOSE") == "1")
        compile_seconds = time.perf_counter() - t0
        log.info("lowlat: extension ready in %.1fs", compile_seconds)
    return _module
