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
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# "avx512": the CPU's own instruction set; "avx2": AVX-512 switched off, so the kernels run on 256-bit halves
# (csrc/avx2.h) as on an AVX2-only CPU (where "native" is that build anyway)
VARIANT_FLAGS = {"avx512": [], "avx2": ["-mno-avx512f"]}
_modules: dict = {}
compile_seconds: float | None = None  # wall time of the last load() that built or found an extension


def _cpu_key() -> str:
    """-march=native code is only valid on the CPU it was built for: the cache name carries the CPU's identity."""
    from lanner.cpu import cpu_flags, cpu_name

    return hashlib.sha1((cpu_name() + " ".join(sorted(cpu_flags()))).encode()).hexdigest()[:8]


def load(variant: str = "avx512"):
    """The extension module of a variant (compiled with torch.utils.cpp_extension.load into torch's extension
    cache, ~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR; rebuilt only when the sources change)."""
    global compile_seconds
    if variant not in _modules:
        from torch.utils.cpp_extension import load as cpp_load

        t0 = time.perf_counter()
        # lowlat.cpp includes every header in csrc/: their hash goes into the flags, so editing one rebuilds
        digest = hashlib.sha1(b"".join(h.name.encode() + h.read_bytes() for h in sorted(CSRC.glob("*.h"))))
        headers = digest.hexdigest()[:12]
        suffix = "" if variant == "avx512" else f"_{variant}"
        _modules[variant] = cpp_load(
            name=f"lanner_lowlat_{_cpu_key()}{suffix}", sources=[str(s) for s in SOURCES],
            extra_cflags=[*CFLAGS, *VARIANT_FLAGS[variant], f"-DLOWLAT_HEADERS={headers}"],
            extra_ldflags=["-fopenmp"], verbose=os.environ.get("LANNER_LOWLAT_VERBOSE") == "1")
        compile_seconds = time.perf_counter() - t0
        log.info("lowlat: %s extension ready in %.1fs", variant, compile_seconds)
    return _modules[variant]
