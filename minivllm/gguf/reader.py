"""A fast GGUF reader: metadata and tensor index parsed once, tensor data memory-mapped.

`gguf.GGUFReader` builds a numpy view per array element, which costs ~8 s on a Qwen
vocabulary (150k tokens + 150k merges). Here the header is walked with plain `struct`
calls over one `bytes` object: strings become `str`, numeric arrays become one
`numpy` array each, and tensor bytes are never read until someone asks for them.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv × (string key, u32 value_type, value)
    n_tensors × (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data section.

The file is untrusted input. Every count and length is checked against the bytes left
before anything is allocated or looped over, and every tensor's type id, shape (at most
4 dims, no int64 overflow, whole blocks per row) and data range (aligned, inside the
file, not overlapping another tensor) is validated; anything else is a `GGUFFormatError`
naming the key or tensor. `require_as`/`get_as` check a metadata value's type
(`InvalidMetadataError`). tests/integration/gguf/test_model_file_fuzz.py feeds it hostile files.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minivllm.errors import GGUFFormatError, InvalidMetadataError, MissingMetadataError, MissingTensorError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays of ...; real files use none, llama.cpp reads none
_INT64_MAX = 2**63 - 1
# The fewest bytes one entry can take, to reject absurd counts before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, ggml type, offset
_REPAIR = "the file is truncated or corrupt: download (or convert) it again"

# GGUF metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALAR = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
               7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# Bytes the smallest element of an array of each type takes.
_MIN_ITEM_BYTES = {t: struct.calcsize(fmt) for t, (fmt, _) in _SCALAR.items()} | {_STRING: 8, _ARRAY: 4 + 8}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. `shape` is in torch order (rows, cols)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Sequential little-endian decoding over an in-memory header.

    Every count read from the file is checked against the bytes left before anything
    is allocated or looped over, so a hostile count (2**62 strings) fails at once with a
    `GGUFFormatError` instead of exhausting memory. `where` names what is being read
    (a metadata key, a tensor) for the error message.
    """

    def __init__(self, buf: bytes | mmap.mmap, path: str):
        self.buf = buf
        self.end = len(buf)
        self.pos = 0
        self.path = path
        self.where = "header"

    def error(self, problem: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {self.where}: {problem}; {_REPAIR}")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise self.error(f"truncated GGUF header at byte {self.pos} (file has {self.end} bytes)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def unpack_many(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise self.error(f"truncated GGUF header at byte {self.pos} (file has {self.end} bytes)")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > self.end - self.pos:
            raise self.error(
                f"string length {n} at byte {self.pos - 8} runs past the end of the file "
                f"({self.end - self.pos} bytes left)"
            )
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth)
        raise self.error(f"unknown metadata value type {vtype} at byte {self.pos - 4} (known: 0..12)")

    def array(self, depth: int = 0) -> Any:
        etype = self.unpack("<I")
        count = self.unpack("<Q")
        if etype not in _MIN_ITEM_BYTES:
            raise self.error(f"array of unknown element type {etype} at byte {self.pos - 12} (known: 0..12)")
        left = self.end - self.pos
        if count * _MIN_ITEM_BYTES[etype] > left:
            raise self.error(
                f"array count {count} of {_TYPE_NAMES[etype]} values needs at least "
                f"{count * _MIN_ITEM_BYTES[etype]} bytes but only {left} are left in the file "
                f"(truncated array at byte {self.pos})"
            )
        if etype in _SCALAR:
            dtype = np.dtype(_SCALAR[etype][1]).newbyteorder("<")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        if etype == _STRING:
            # The hot loop of the whole reader (vocabularies, merges): keep it tight.
            buf, pos, end, out = self.buf, self.pos, self.end, []
            append, from_bytes = out.append, int.from_bytes
            for _ in range(count):
                start = pos + 8
                pos = start + from_bytes(buf[start - 8 : start], "little")
                if pos > end:  # before slicing: a hostile length never copies the file
                    raise self.error(
                        f"truncated array of {count} strings: the element at byte {start - 8} "
                        f"(length {pos - start}) runs past the end of the file"
                    )
                append(buf[start:pos].decode("utf-8", "replace"))
            self.pos = pos
            return out
        if depth >= _MAX_NESTING:
            raise self.error(f"arrays nested more than {_MAX_NESTING} deep at byte {self.pos - 12}")
        return [self.array(depth + 1) for _ in range(count)]


class GGUFFile:
    """An opened GGUF file: `metadata`, `tensors`, and lazy memory-mapped tensor bytes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fh = open(self.path, "rb")
        except OSError as exc:
            raise GGUFFormatError(f"cannot open GGUF file {self.path}: {exc.strerror}") from exc
        with fh:
            try:
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFFormatError(f"{self.path} is empty, not a GGUF file") from exc
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()
        # Copy-on-write map: torch needs a writable buffer, and "c" keeps pages shared
        # with the page cache until (never) written.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="c")

    # -- parsing -------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mm, str(self.path))
        if self._mm[:4] != _MAGIC:
            raise GGUFFormatError(
                f"{self.path} is not a GGUF file (magic {bytes(self._mm[:4])!r}, expected b'GGUF')"
            )
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        need = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
        if need > cur.end - cur.pos:
            raise cur.error(
                f"the header counts n_kv={n_kv} metadata entries and n_tensors={n_tensors} tensors, "
                f"which need at least {need} bytes, but the file has {cur.end - cur.pos} bytes after the header"
            )
        metadata = self.metadata
        for i in range(n_kv):
            cur.where = f"metadata entry #{i}"
            key = cur.string()
            cur.where = f"metadata key {key!r}"
            if key in metadata:
                raise cur.error(f"duplicate metadata key {key!r} (the key appears twice)")
            metadata[key] = cur.value(cur.unpack("<I"))

        alignment = self.get_as("general.alignment", "int", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidMetadataError("general.alignment", str(self.path), f"is {alignment}, expected a power of two")

        infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            cur.where = f"tensor info #{i}"
            name = cur.string()
            cur.where = f"tensor {name!r}"
            if name in seen:
                raise cur.error(f"duplicate tensor name {name!r} (two tensors share it)")
            seen.add(name)
            n_dims = cur.unpack("<I")
            if n_dims > _MAX_DIMS:
                raise cur.error(f"n_dims={n_dims}, but GGUF tensors have at most {_MAX_DIMS} dimensions")
            dims = cur.unpack_many(f"<{n_dims}Q")
            raw_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            n = 1
            for d in dims:
                if d > _INT64_MAX:
                    raise cur.error(f"dimension {d} (as int64: {d - 2**64}) of shape {list(dims)} is negative")
                n *= d
            if n > _INT64_MAX:
                raise cur.error(f"shape {list(dims)} has {n} elements, which overflows int64")
            try:
                gtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise cur.error(
                    f"unknown ggml type id {raw_type} (this gguf package knows "
                    f"ids {int(min(GGMLQuantizationType))}..{int(max(GGMLQuantizationType))})"
                ) from None
            block, type_bytes = GGML_QUANT_SIZES[gtype]
            row = dims[0] if dims else 1
            if row % block:
                raise cur.error(
                    f"row length {row} is not a multiple of the {gtype.name} block size {block}"
                )
            if offset % alignment:
                raise cur.error(f"data offset {offset} is not a multiple of general.alignment={alignment}")
            infos.append((name, tuple(reversed(dims)), gtype, offset, n // block * type_bytes))

        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.data_offset = data_start
        size = len(self._mm)
        for name, shape, gtype, offset, nbytes in infos:
            start = data_start + offset
            if start + nbytes > size:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} runs past the end of the file (data offset {offset}, "
                    f"{nbytes} bytes: needs bytes {start}..{start + nbytes}, file has {size}); {_REPAIR}"
                )
            self.tensors[name] = TensorInfo(name, shape, gtype, start, nbytes)
        # No two tensors may share bytes (llama.cpp requires them packed in order).
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (_, a_end, a), (b_start, _b_end, b) in zip(spans, spans[1:]):
            if b_start < a_end:
                raise GGUFFormatError(
                    f"{self.path}: tensors {a!r} and {b!r} overlap (data offset {b_start - data_start} "
                    f"lies inside {a!r}, which ends at {a_end - data_start}); {_REPAIR}"
                )

    # -- access --------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.require_as("general.architecture", "str")

    def require(self, key: str) -> Any:
        """A metadata value that must exist; the error names the key and the file."""
        if key not in self.metadata:
            raise MissingMetadataError(key, str(self.path))
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require_as(self, key: str, kind: str) -> Any:
        """`require(key)`, checked to be of `kind` ("int", "float", "str", "bool",
        "strings", "ints"); a value of another type raises `InvalidMetadataError`."""
        return self._checked(key, kind, self.require(key))

    def get_as(self, key: str, kind: str, default: Any = None) -> Any:
        """`get(key, default)`, checked like `require_as` when the key is present."""
        if key not in self.metadata:
            return default
        return self._checked(key, kind, self.metadata[key])

    def _checked(self, key: str, kind: str, value: Any) -> Any:
        expected, ok = _KINDS[kind]
        if not ok(value):
            raise InvalidMetadataError(key, str(self.path), f"is {_describe(value)}, expected {expected}")
        return value

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(name, str(self.path))
        return self.tensors[name]

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """The tensor's raw bytes as a 1-D uint8 CPU tensor backed by the memory map."""
        info = self.tensor_info(name)
        return torch.from_numpy(self._data[info.offset : info.offset + info.nbytes])

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        arch = self.metadata.get("general.architecture")
        return f"GGUFFile({str(self.path)!r}, arch={arch!r}, tensors={len(self.tensors)})"


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# kind -> (what the error says was expected, check). Arrays are homogeneous (one element
# type per GGUF array), so the first element of a list tells what the list holds.
_KINDS = {
    "int": ("an integer", _is_int),
    "float": ("a number", lambda v: _is_int(v) or isinstance(v, (float, np.floating))),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("a bool", lambda v: isinstance(v, (bool, np.bool_))),
    "strings": ("an array of strings", lambda v: isinstance(v, list) and (not v or isinstance(v[0], str))),
    "ints": ("an array of integers",
             lambda v: isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu"),
}


def _describe(value: Any) -> str:
    """A short description of a metadata value for error messages."""
    if isinstance(value, (bool, np.bool_)):
        return f"the bool {bool(value)}"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:40] + "..."
        return f"the string {text!r}"
    if isinstance(value, (int, float, np.number)):
        return f"the number {value!r}"
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype} values"
    if isinstance(value, list):
        inner = "strings" if value and isinstance(value[0], str) else "arrays"
        return f"an array of {len(value)} {inner}"
    return f"a {type(value).__name__}"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
