"""GGUF weights kept in their stored type (issue 18). Each supported block type is repacked once at load into one
of two SIMD-friendly formats without changing any value (every weight still dequantizes to the same float32):

  "u4": 4-bit unsigned codes q with a float16 scale d and offset m per block of 32 (value = d * q + m). Q4_1 as is;
        Q4_0 (d * (q - 8)) with m = -8 d (exact in float16). Codes of two consecutive blocks share 32 bytes: byte i
        holds element i of the even block in its low nibble and element i of the odd block in its high nibble, so
        one 32-byte load unpacks into 64 codes in element order (qs [N, blocks / 2, 32] uint8).
  "s8": signed 8-bit codes with a float16 scale per block of 32 (value = d * q): Q8_0 as is, Q5_0 (d * (q - 16))
        widened to 8 bits (qs [N, blocks, 32] int8; 34 instead of 22 bytes per block for Q5_0).

  K-quants, whose 256-element super-blocks scale sub-blocks by 6- or 8-bit integers, keep the same code layouts
  and their scales as stored: the integer sub-block scales (and Q4_K's mins) as bytes, the float16 super-block
  scales beside them. The kernels multiply them out per sub-block (exact in float32: an 11-bit significand times
  an integer of at most 8 bits), so a K-quant costs its file's bytes plus a quarter bit per weight:
  "u4k": Q4_K: u4 codes (its 32-byte chunks are already in the u4 pair layout), per block of 32 the scale sc and
        min mn (uint8), per super-block sd = d and sm = -dmin (float16): value = (sd * sc) * q + sm * mn.
  "u6k": Q6_K: its 6-bit codes u = q + 32 (value = (sd * sc) * (u - 32)), per 16 elements the scale sc (int8), per
        super-block sd = d. A block's 32 codes take 24 bytes: bytes 4t + e (t < 4, e < 4) hold the low 4 bits of
        elements 4t + e (low nibble) and 16 + 4t + e (high nibble), bytes 16 + 4h + e the high 2 bits of elements
        16h + 4s + e at bits 2s (lowlat's u6_codes unpacks 4 codes of 16 rows per vector from them).
  "u5k": Q5_K: its 5-bit codes in u6k's byte layout, with Q4_K's scales, mins and super-block scales.

Rows are padded to an even block count (zero codes, zero scales; K-quant rows never need it). A module holds its
rows interleaved in groups of GROUP = 16 (`interleave`): qs [groups, chunks, 8, 16, 4], where a chunk is a row's
32 bytes of codes (a u4 block pair, an s8 block) and [t, i] holds bytes 4t..4t+3 of the group's row i, and
scales [groups, blocks, 16]. lowlat's kernels then run 16 rows per vector (one row per 32-bit lane) against
broadcast activations (lanner/plugins/lowlat/csrc/quant.h); the last group is padded with zero rows. Float16 scales
are kept as raw bits in int16 buffers, so that `model.to(dtype)` leaves them alone. The engine's own forward (other devices, prefill
with `lowlat.prefill_rows=0`, a fallback) uses these same buffers: `QuantLinear` dequantizes 4096-row tiles on the fly inside its matmul
(on the CPU through lowlat's one-pass `dequant_t` when lowlat runs the model), so no second, dense copy of the
weights exists. lowlat's C++ kernels read the buffers directly.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("lanner")

BLOCK = 32
TILE_ROWS = 4096  # output rows dequantized at a time by the on-the-fly matmul (bounds its scratch memory)
# GGUF type name -> (repacked format, GGUF bytes per block)
STORED_TYPES = {"Q4_0": ("u4", 18), "Q4_1": ("u4", 20), "Q5_0": ("s8", 22), "Q8_0": ("s8", 34),
                "Q4_K": ("u4k", 144), "Q5_K": ("u5k", 176), "Q6_K": ("u6k", 210)}
SUPER = 256  # elements per K-quant super-block
# each format's tensors in the order the kernels take them (repack()'s keys, QuantLinear's buffers)
PARTS = {"u4": ("qs", "d", "m"), "s8": ("qs", "d"), "u4k": ("qs", "sc", "mn", "sd", "sm"), "u6k": ("qs", "sc", "sd"),
         "u5k": ("qs", "sc", "mn", "sd", "sm")}


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int16)


def repack(raw: np.ndarray, type_name: str, k: int) -> dict[str, torch.Tensor]:
    """raw: a GGUF tensor's bytes, uint8 [N, bytes per row]; k: the row length in elements. -> {"qs", "d"[, "m"]}
    in the format of STORED_TYPES[type_name] (module docstring)."""
    fmt, bb = STORED_TYPES[type_name]
    per = SUPER if fmt.endswith("k") else BLOCK
    n, nb = raw.shape[0], k // per
    if k % per or raw.shape[1] != nb * bb:
        raise ValueError(f"{type_name} tensor of {k} columns holds {raw.shape[1]} bytes per row, expected {nb * bb}")
    blocks = raw.reshape(n, nb, bb)
    if fmt.endswith("k"):
        return _repack_k(blocks, type_name)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    nbp = nb + nb % 2
    pad = lambda a: np.concatenate([a, np.zeros((n, nbp - nb) + a.shape[2:], a.dtype)], axis=1) if nbp > nb else a
    if fmt == "u4":
        if type_name == "Q4_1":
            m, nib = blocks[:, :, 2:4].copy().view(np.float16)[..., 0], blocks[:, :, 4:20]
        else:
            m, nib = (d.astype(np.float32) * -8).astype(np.float16), blocks[:, :, 2:18]
        codes = np.concatenate([nib & 15, nib >> 4], axis=2)  # [n, nb, 32] in element order
        codes = pad(codes).reshape(n, nbp // 2, 2, BLOCK)
        qs = codes[:, :, 0] | (codes[:, :, 1] << 4)
        return {"qs": torch.from_numpy(np.ascontiguousarray(qs)), "d": torch.from_numpy(_f16_bits(pad(d))),
                "m": torch.from_numpy(_f16_bits(pad(m)))}
    if type_name == "Q8_0":
        codes = blocks[:, :, 2:34].view(np.int8)
    else:  # Q5_0: the fifth bits of the 32 elements in a little-endian uint32, then the low nibbles
        qh = blocks[:, :, 2:6].copy().view(np.uint32)[..., 0]
        nib = blocks[:, :, 6:22]
        lo = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int16)
        hi = ((qh[..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int16)
        codes = (lo | (hi << 4)) - 16
    return {"qs": torch.from_numpy(np.ascontiguousarray(pad(codes.astype(np.int8)))),
            "d": torch.from_numpy(_f16_bits(pad(d)))}


def _repack_k(blocks: np.ndarray, type_name: str) -> dict[str, torch.Tensor]:
    """K-quant super-blocks [N, S, bytes] -> "u4k" (Q4_K) / "u5k" (Q5_K) / "u6k" (Q6_K); byte layouts as the gguf
    package reads them (gguf.quants.Q4_K / Q5_K / Q6_K)."""
    from gguf.quants import Q4_K

    n, s = blocks.shape[:2]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    if type_name in ("Q4_K", "Q5_K"):  # d, dmin (float16), 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # fifth bits,) 128 bytes of low nibbles
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * s, 12))
        scales = {"sc": t(sc.reshape(n, -1).astype(np.uint8)), "mn": t(mn.reshape(n, -1).astype(np.uint8)),
                  "sd": t(_f16_bits(d)), "sm": t(_f16_bits(-dmin))}
        if type_name == "Q4_K":  # chunk j: sub-block 2j in low nibbles, 2j + 1 in high
            return {"qs": t(blocks[..., 16:144].reshape(n, s * 4, BLOCK)), **scales}
        lo = (blocks[..., 48:176].reshape(n, s, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
        hi = (blocks[..., 16:48].reshape(n, s, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        return {"qs": t(_pack6(lo.reshape(n, s * 8, BLOCK) | (hi.reshape(n, s * 8, BLOCK) << 4))), **scales}
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d (float16)
    ql, qh = blocks[..., 0:128].reshape(n, s, 2, 1, 64), blocks[..., 128:192].reshape(n, s, 2, 1, 32)
    lo = (ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15  # [n, s, half, 2, 64]: elements 128 h + 64 i + e
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [n, s, half, 4, 32]: 128 h + 32 i + e
    u = lo.reshape(n, s, 2, 128) | (hi.reshape(n, s, 2, 128) << 4)  # 0..63
    return {"qs": t(_pack6(u.reshape(n, s * 8, BLOCK))), "sc": t(blocks[..., 192:208].view(np.int8).reshape(n, -1)),
            "sd": t(_f16_bits(blocks[..., 208:210].copy().view(np.float16)[..., 0]))}


def _pack6(u: np.ndarray) -> np.ndarray:
    """Codes 0..63 [N, blocks, 32] -> u6k's 24 bytes per block (module docstring)."""
    n, nb = u.shape[:2]
    u = u.reshape(n, nb, 2, 16)
    nib = (u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)
    top = (u >> 4).reshape(n, nb, 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)  # [.., h, s, e]
    return np.concatenate([nib, top.sum(axis=3, dtype=np.uint8).reshape(n, nb, 8)], axis=2)


def unit_scales(parts: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 scale (and offset) per scale unit, [rows, units], of a repack() dict (row-major or a row slice)."""
    if "sc" not in parts:
        f = lambda t: t.view(torch.float16).float()
        return f(parts["d"]), None if parts.get("m") is None else f(parts["m"])
    per = parts["sc"].shape[1] // parts["sd"].shape[1]
    sup = lambda t: t.view(torch.float16).float().repeat_interleave(per, dim=1)
    scale = sup(parts["sd"]) * parts["sc"].float()  # exact: an 11-bit significand times a <= 8-bit integer
    return scale, None if "mn" not in parts else sup(parts["sm"]) * parts["mn"].float()


def codes(qs: torch.Tensor) -> torch.Tensor:
    """Row-major packed codes [N, chunks, bytes] -> the integer codes [N, elements] (u4: 0..15, u6k / u5k's layout:
    0..63, s8: as stored)."""
    n = qs.shape[0]
    if qs.dtype == torch.int8:
        return qs.reshape(n, -1)
    if qs.shape[2] == 24:  # u6 (module docstring)
        lo = torch.cat([qs[..., :16] & 15, qs[..., :16] >> 4], dim=2)
        top = qs[..., 16:].reshape(n, -1, 2, 1, 4) >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1)
        return (lo | ((top & 3).reshape(n, -1, 32) << 4)).reshape(n, -1)
    return torch.stack([qs & 15, qs >> 4], dim=2).reshape(n, -1)


def dequantize(parts: dict, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows (a repack() dict, row-major) -> dense [rows, k]. float32 arithmetic (d * q is exact, so
    d * q + m rounds once, like the gguf package and lowlat's float-activation kernels), then one rounding to dtype.
    Each scale covers the codes of its block (32 elements, 16 for "u6k")."""
    d, m = unit_scales(parts)
    n = parts["qs"].shape[0]
    q = codes(parts["qs"])
    if parts["qs"].shape[2] == 24 and "mn" not in parts:  # u6k: Q6_K's codes are u - 32
        q = q.to(torch.int8) - 32
    w = q.reshape(n, d.shape[1], -1).float() * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(n, -1)[:, :k].to(dtype)


GROUP = 16  # weight rows interleaved per group


def interleave(parts: dict) -> list[torch.Tensor]:
    """repack()'s row-major [N, chunks, 32] codes and [N, units] scales -> the grouped layout (module docstring),
    in the format's PARTS order; N is padded to whole groups with zero rows."""
    n = parts["qs"].shape[0]
    pad = -n % GROUP

    def grouped(t):
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
        g = t.shape[0] // GROUP
        if t.dim() == 2:  # scales
            return t.reshape(g, GROUP, -1).transpose(1, 2).contiguous()
        return t.reshape(g, GROUP, t.shape[1], -1, 4).permute(0, 2, 3, 1, 4).contiguous()

    return [grouped(t) for t in parts.values()]


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of a grouped buffer in repack()'s row-major layout."""
    g, i = idx // GROUP, idx % GROUP
    if t.dim() == 3:  # scales [groups, units, 16]
        return t[g, :, i]
    return t[g, :, :, i, :].reshape(len(idx), t.shape[1], -1)  # codes [groups, chunks, vectors, 16, 4]


def _row_range(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b-1 (a a multiple of GROUP) of a grouped buffer in repack()'s row-major layout: a strided copy of
    whole groups (the on-the-fly matmul's tiles; _rows' gather took most of a quantized prefill's dequantization)."""
    t = t[a // GROUP : -(-b // GROUP)]
    if t.dim() == 3:  # scales [groups, units, 16]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: b - a]
    return t.permute(0, 3, 1, 2, 4).reshape(-1, t.shape[1], t.shape[2] * 4)[: b - a]  # codes


class QuantLinear(nn.Module):
    """A linear layer (or the tied embedding / LM head) over repacked GGUF blocks, rows interleaved in groups of
    16; see the module docstring. `weight` (a dense copy made on each access) exists for callers that need the
    matrix itself; the forward never builds it whole."""

    def __init__(self, out_features: int, in_features: int, fmt: str, bias: bool = False,
                 pieces: list[int] | None = None, device=None):
        super().__init__()
        nbp = -(-in_features // BLOCK)
        nbp += nbp % 2
        groups = -(-out_features // GROUP)
        self.out_features, self.in_features, self.fmt = out_features, in_features, fmt
        self.dtype = torch.float32  # the activations' dtype; set by the loader
        kw = {"device": device}
        chunks = nbp // 2 if fmt.startswith("u4") else nbp
        code = torch.int8 if fmt == "s8" else torch.uint8
        units = nbp * (2 if fmt == "u6k" else 1)
        vectors = 6 if fmt in ("u6k", "u5k") else 8  # 64-byte vectors per chunk of a group
        shapes = {"qs": ((chunks, vectors, GROUP, 4), code), "d": ((units, GROUP), torch.int16),
                  "m": ((units, GROUP), torch.int16),
                  "sc": ((units, GROUP), torch.int8 if fmt == "u6k" else torch.uint8),
                  "mn": ((units, GROUP), torch.uint8), "sd": ((nbp // 8, GROUP), torch.int16),
                  "sm": ((nbp // 8, GROUP), torch.int16)}
        for name in PARTS[fmt]:
            shape, dtype = shapes[name]
            self.register_buffer(name, torch.zeros(groups, *shape, dtype=dtype, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.offsets = np.cumsum([0, *(pieces or [out_features])]).tolist()  # fused pieces' first rows
        self.pieces = pieces or [out_features]
        # a CPU plugin's one-pass dequantizer, (packed, N, K, a, b, to_bf16) -> rows a..b-1 as [K, >= b - a]
        # (lowlat's dequant_t, attached at its build); None: the torch ops of `dense`
        self.tile_kernel = None

    def _dequantize(self, idx: torch.Tensor, dtype) -> torch.Tensor:
        return dequantize({n: _rows(t, idx) for n, t in self.parts().items()}, self.in_features, dtype)

    def dense(self, rows: slice = slice(None), dtype=None) -> torch.Tensor:
        a, b, step = rows.indices(self.out_features)
        if step != 1 or a % GROUP or a >= b:
            return self._dequantize(torch.arange(self.out_features, device=self.qs.device)[rows], dtype or self.dtype)
        return dequantize({n: _row_range(t, a, b) for n, t in self.parts().items()}, self.in_features,
                          dtype or self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias), dequantizing TILE_ROWS rows of W at a time."""
        tiles = [F.linear(x, self._tile(r, min(r + TILE_ROWS, self.out_features), x))
                 for r in range(0, self.out_features, TILE_ROWS)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
        return y if self.bias is None else y + self.bias

    def _tile(self, a: int, b: int, x: torch.Tensor) -> torch.Tensor:
        """Rows a..b-1 of W in x's dtype (the same values either way; the kernel's tile is transposed, which
        F.linear takes as it is)."""
        if self.tile_kernel is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            t = self.tile_kernel(self.packed(), self.out_features, self.in_features, a, b, x.dtype == torch.bfloat16)
            return t[:, : b - a].T
        return self.dense(slice(a, b), x.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the matrix (the embedding lookup)."""
        return self._dequantize(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.in_features)

    def parts(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in PARTS[self.fmt]}

    def packed(self) -> list[torch.Tensor]:
        """The kernels' weight: the format's buffers in PARTS order."""
        return list(self.parts().values())

    @torch.no_grad()
    def load(self, name: str, tensor, piece: int = 0):
        """A piece of the fused rows: `tensor` is a repack() dict for the weight, a dense tensor for the bias."""
        r0 = self.offsets[piece]
        if name == "bias":
            self.bias[r0 : r0 + tensor.shape[0]].copy_(tensor)
            return
        n = tensor["qs"].shape[0]
        chunk = (self.qs.shape[1], self.qs.shape[2] * 4)  # a row's chunks and bytes per chunk
        if r0 + n > self.offsets[piece + 1] or tensor["qs"].shape[1:] != chunk:
            raise ValueError(f"quantized piece {piece} of shape {tuple(tensor['qs'].shape)} does not fit "
                             f"{self.out_features} rows of {chunk[0]} x {chunk[1]} code bytes at row {r0}")
        idx = torch.arange(r0, r0 + n)
        g, i = idx // GROUP, idx % GROUP
        for name, buf in self.parts().items():
            if buf.dim() == 3:  # scales [groups, units, 16]
                buf[g, :, i] = tensor[name]
            else:
                buf[g, :, :, i, :] = tensor[name].reshape(n, buf.shape[1], buf.shape[2], 4)


class QuantEmbedding(QuantLinear):
    """The token embedding over quantized rows (also the LM head when tied: `forward` is the lookup, `linear` the
    head's `matmul`)."""

    def forward(self, ids):
        return self.embed(ids)


class MixedQuantLinear(nn.Module):
    """A fused projection whose pieces are stored in different formats (Qwen2.5 Q4_K_M: Q4_K q / k beside a Q6_K v):
    one QuantLinear per run of pieces sharing a format, over its own rows (runs start at multiples of GROUP, so each
    is whole groups). Kernels take `packed()`, the runs' buffers one after another, as row segments."""

    def __init__(self, out_features: int, in_features: int, fmts: list[str], pieces: list[int], bias: bool = False,
                 device=None):
        super().__init__()
        runs: list[tuple[str, list[int]]] = []
        self._where = []  # piece -> (run, piece within the run)
        for fmt, n in zip(fmts, pieces):
            if not runs or runs[-1][0] != fmt:
                runs.append((fmt, []))
            self._where.append((len(runs) - 1, len(runs[-1][1])))
            runs[-1][1].append(n)
        self.runs = nn.ModuleList(QuantLinear(sum(sizes), in_features, fmt, pieces=sizes, device=device)
                                  for fmt, sizes in runs)
        self.out_features, self.in_features, self.pieces = out_features, in_features, list(pieces)
        self.offsets = np.cumsum([0, *pieces]).tolist()
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @property
    def dtype(self) -> torch.dtype:
        return self.runs[0].dtype

    @dtype.setter
    def dtype(self, dtype: torch.dtype):
        for r in self.runs:
            r.dtype = dtype

    def dense(self, rows: slice = slice(None), dtype=None) -> torch.Tensor:
        return torch.cat([r.dense(dtype=dtype) for r in self.runs])[rows]

    @property
    def weight(self) -> torch.Tensor:
        return self.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([r.matmul(x) for r in self.runs], dim=-1)
        return y if self.bias is None else y + self.bias

    matmul = forward

    def packed(self) -> list[torch.Tensor]:
        return [t for r in self.runs for t in r.packed()]

    @torch.no_grad()
    def load(self, name: str, tensor, piece: int = 0):
        if name == "bias":
            self.bias[self.offsets[piece] : self.offsets[piece] + tensor.shape[0]].copy_(tensor)
            return
        run, local = self._where[piece]
        self.runs[run].load(name, tensor, local)


STORED_MODULES = (QuantLinear, MixedQuantLinear)  # modules whose weights are GGUF blocks (`packed()`)


def parameter_count(model: nn.Module) -> int:
    """The model's weights as elements: stored blocks count as the matrices they hold."""
    stored = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
    return stored + sum(p.numel() for p in model.parameters())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (distinct storages)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def stored_plan(model: nn.Module, tensors, hf_name) -> dict[str, tuple]:
    """Which modules can hold their GGUF tensors as stored: module name -> (format per piece, [(gguf tensor,
    piece)]). A module qualifies when all its pieces are of STORED_TYPES and its class is one we replace (column /
    row linear, vocab embedding) on a single rank; a fused one whose pieces differ in format (MixedQuantLinear) when
    each change of format falls on a multiple of GROUP rows."""
    from lanner.distributed import tp_size
    from lanner.distributed.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if tp_size() > 1:
        return {}
    modules = dict(model.named_modules())
    groups: dict[str, list] = {}
    for t in tensors:
        mapped = model.checkpoint_name(hf_name(t.name))
        if mapped is None:
            continue
        pname, piece = mapped
        owner, _, leaf = pname.rpartition(".")
        if leaf == "weight":
            groups.setdefault(owner, []).append((t, piece))
    plan, skipped = {}, set()
    for owner, items in groups.items():
        mod = modules.get(owner)
        sizes = list(getattr(mod, "local_sizes", [0]))
        fmts = [None] * len(sizes)
        for t, piece in items:
            if piece < len(fmts):
                fmts[piece] = STORED_TYPES.get(t.tensor_type.name, (None,))[0]
        starts = np.cumsum([0, *sizes])
        aligned = all(starts[i] % GROUP == 0 for i in range(1, len(fmts)) if fmts[i] != fmts[i - 1])
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) or \
                None in fmts or len(items) != len(fmts) or not aligned:
            skipped |= {(t.tensor_type.name, t.name) for t, _ in items}
            continue
        plan[owner] = (fmts, items)
    # the documented rule (docs/quantized.md): a quantized type without a kernel runs dequantized, with a warning
    skipped = sorted((ty, name) for ty, name in skipped if ty not in ("F32", "F16", "BF16"))
    if skipped:
        log.warning("GGUF: %d quantized tensor(s) run dequantized to the model dtype (no stored-type kernel for "
                    "their type, or a fused projection whose types change off a 16-row boundary): %s%s",
                    len(skipped), ", ".join(f"{name} ({ty})" for ty, name in skipped[:4]),
                    " ..." if len(skipped) > 4 else "")
    return plan


def install(model: nn.Module, plan: dict[str, tuple]) -> None:
    """Replaces each planned module (still on the meta device) by its QuantLinear / MixedQuantLinear /
    QuantEmbedding."""
    from lanner.distributed.layers import VocabParallelEmbedding

    for owner, (fmts, _) in plan.items():
        parent_name, _, attr = owner.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, VocabParallelEmbedding):
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, fmts[0], device="meta")
        elif len(set(fmts)) > 1:
            new = MixedQuantLinear(old.out_features, old.in_features, fmts, list(old.local_sizes),
                                   bias=old.bias is not None, device="meta")
        else:
            new = QuantLinear(old.out_features, old.in_features, fmts[0], bias=old.bias is not None,
                              pieces=list(old.local_sizes), device="meta")
        setattr(parent, attr, new)


def load_stored(model: nn.Module, plan: dict[str, tuple], dtype: torch.dtype, permute) -> None:
    """Fills the installed modules from their GGUF tensors; permute(tensor, packed rows) reorders rows where the
    converter permuted them (llama q/k)."""
    for owner, (_, items) in plan.items():
        mod = model.get_submodule(owner)
        mod.dtype = dtype
        for buf in mod.packed():  # to_empty left them uninitialized: the last group's padding rows stay zero
            buf.zero_()
        for t, piece in items:
            packed = repack(np.asarray(t.data), t.tensor_type.name, int(t.shape[0]))
            mod.load("weight", {k: permute(t, v) for k, v in packed.items()}, piece)
