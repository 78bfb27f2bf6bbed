"""What this machine's CPU is (/proc/cpuinfo), read once: the kernels' build key, the plugins' checks and the
engine's default dtype depend on it."""
from __future__ import annotations

import functools
import platform

import torch


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset:
    """e.g. {"avx2", "avx512f", "avx512_bf16", ...}; empty where /proc/cpuinfo is not readable."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or "cpu"


def native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512_BF16 or AMX). Without it PyTorch's bf16 GEMM converts every
    operand and runs ~4x slower than float32 (AMD EPYC, AVX2: 4.1 vs 16.0 GFLOP/s at 128 x 576 x 1536)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def amx_usable() -> bool:
    """PyTorch's bf16 GEMM (oneDNN) can run on AMX tiles here: the CPU has them and the OS lets this process use
    them (some VMs list amx flags but do not grant the tile state, which oneDNN then skips)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except (AttributeError, RuntimeError):  # a torch without these (private) hooks
        return False
