"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf.GGUFReader builds a numpy view for every element of every metadata array: 6 s for the bundled model's
49,152-token vocabulary and about 30 s for Gemma 3's 262,144, on each load. Here strings are decoded and numeric
arrays taken as whole buffers, which reads the same header in well under a second. Tensors keep gguf's conventions
(ReaderTensor: `data` a view of the memory-mapped file, shaped like GGUFReader's: typed for float / integer types,
bytes per row for block types), so gguf.quants.dequantize and Lanner's repacking take them as they are.
"""
from __future__ import annotations

import struct

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)  # version 1 had 32-bit lengths
_SCALARS = {  # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64), GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class GGUFFile:
    """fields: key -> value (int, float, bool, str; arrays as lists, numeric ones as numpy arrays); tensors: a
    ReaderTensor per tensor, in file order. Raises ValueError on a file that does not parse or whose tensors do not
    fit in it."""

    def __init__(self, path: str):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._off = 0
        self.fields: dict = {}
        self.tensors: list[ReaderTensor] = []
        if self._unpack("<I") != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        version = self._unpack("<I")
        if version not in VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version}{hint}; Lanner reads versions {VERSIONS}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        for _ in range(n_kv):
            key = self._str()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [(self._str(), [self._unpack("<Q") for _ in range(self._unpack("<I"))], self._unpack("<I"),
                  self._unpack("<Q")) for _ in range(n_tensors)]
        align = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        self.data_offset = -(-self._off // align) * align
        size = len(self.data)
        for name, dims, raw_type, offset in infos:
            try:
                ttype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has GGML type id {raw_type}, which no GGUF version defines") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[ttype]
            n_bytes = n_elems // block * type_size
            start = self.data_offset + offset
            if start + n_bytes > size:
                raise ValueError(f"truncated GGUF file: tensor {name!r} ends at byte {start + n_bytes}, the file "
                                 f"has {size}")
            shape = tuple(reversed(dims))
            if ttype in _TYPED:
                view = np.frombuffer(self.data, _TYPED[ttype], n_elems, start)
            else:
                view, shape = self.data[start:start + n_bytes], quant_shape_to_byte_shape(shape, ttype)
            self.tensors.append(ReaderTensor(name=name, tensor_type=ttype, shape=np.array(dims, dtype=np.uint64),
                                             n_elements=n_elems, n_bytes=n_bytes, data_offset=start,
                                             data=view.reshape(shape), field=None))
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._unpack("<Q")
        end = self._off + n
        if end > len(self._buf):
            raise ValueError(f"a string of {n} bytes at byte {self._off} runs past the end of the file")
        s = str(self._buf[self._off:end], "utf-8")
        self._off = end
        return s

    def _value(self, raw_type: int):
        vtype = GGUFValueType(raw_type)
        if vtype == GGUFValueType.STRING:
            return self._str()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype][0])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {raw_type}")
        item, n = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if item in _SCALARS:  # one buffer
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            arr = np.frombuffer(self._buf, dtype, n, self._off).copy()
            self._off += arr.nbytes
            return arr
        if item == GGUFValueType.STRING:  # a vocabulary: the hot loop of a load
            buf, off, out, end = self._buf, self._off, [], len(self._buf)
            for _ in range(n):
                (k,) = struct.unpack_from("<Q", buf, off)
                if off + 8 + k > end:
                    raise ValueError(f"a string of {k} bytes at byte {off + 8} runs past the end of the file")
                out.append(str(buf[off + 8:off + 8 + k], "utf-8"))
                off += 8 + k
            self._off = off
            return out
        return [self._value(item) for _ in range(n)]
