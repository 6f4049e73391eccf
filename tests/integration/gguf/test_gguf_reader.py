"""`minivllm.gguf.reader.GGUFFile` against independent references.

* Real files (smollm2, Qwen2.5-Coder): every metadata key/value, the tensor index and
  raw tensor bytes must equal what gguf-py's own `gguf.GGUFReader` reports.
* Files written in tmp_path with `gguf.GGUFWriter`: every metadata value type must
  round-trip to the values the test wrote; damaged files must raise the documented
  errors (`GGUFFormatError`, `MissingMetadataError`, `MissingTensorError`).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from minivllm.errors import GGUFFormatError, MinivllmError, MissingMetadataError, MissingTensorError
from minivllm.gguf.reader import GGUFFile

V = GGUFValueType

# GGUF value type -> numpy dtype of a numeric array element.
_NP = {
    V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16,
    V.UINT32: np.uint32, V.INT32: np.int32, V.FLOAT32: np.float32, V.BOOL: np.bool_,
    V.UINT64: np.uint64, V.INT64: np.int64, V.FLOAT64: np.float64,
}
_PSEUDO_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


# --- real files vs gguf.GGUFReader --------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "qwen05"])
def real(request):
    """(ours, gguf-py reader, gguf-py field contents) for one real model; built once."""
    path = request.getfixturevalue(f"{request.param}_path")
    ref = GGUFReader(path)  # slow (~5 s smollm2, ~13 s Qwen): once per module
    contents = {k: f.contents() for k, f in ref.fields.items() if k not in _PSEUDO_FIELDS}
    ours = GGUFFile(path)
    yield ours, ref, contents
    ours.close()


def test_header_matches_gguf_reader(real):
    ours, ref, _ = real
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert len(ours.tensors) == ref.fields["GGUF.tensor_count"].contents()
    assert len(ours.metadata) == ref.fields["GGUF.kv_count"].contents()
    assert ours.data_offset == ref.data_offset


def test_metadata_matches_gguf_reader(real):
    ours, ref, contents = real
    assert list(ours.metadata) == list(contents)  # same keys, same order
    for key, field in ref.fields.items():
        if key in _PSEUDO_FIELDS:
            continue
        want, got = contents[key], ours.metadata[key]
        main = field.types[0]
        if main == V.STRING:
            assert isinstance(got, str) and got == want, key
        elif main == V.ARRAY:
            sub = field.types[-1]
            assert len(field.types) == 2, f"{key}: nested arrays not expected in real files"
            if sub == V.STRING:
                assert isinstance(got, list) and got == want, key
            else:
                assert isinstance(got, np.ndarray) and got.dtype == _NP[sub], (key, got.dtype)
                assert got.tolist() == want, key
        else:
            assert type(got) is type(want) and got == want, (key, got, want)


def test_tokenizer_arrays_match(real):
    """The big arrays, spelled out (these feed the tokenizer)."""
    ours, ref, contents = real
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        want = contents[key]
        got = ours.require(key)
        assert len(got) == len(want) > 1000, key
        assert list(got) == want, key
    assert len(ours.require("tokenizer.ggml.tokens")) == len(ours.require("tokenizer.ggml.token_type"))


def test_tensor_index_matches_gguf_reader(real):
    ours, ref, _ = real
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensor_info(t.name)
        assert info.shape == tuple(reversed([int(d) for d in t.shape])), t.name  # ggml order reversed
        assert info.ggml_type == t.tensor_type, t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name
        assert info.n_elements == t.n_elements, t.name


def test_tensor_bytes_match_gguf_reader(real):
    ours, ref, _ = real
    # First, last, and the first tensor of every ggml type in the file.
    picked = {ref.tensors[0].name: ref.tensors[0], ref.tensors[-1].name: ref.tensors[-1]}
    seen_types = set()
    for t in ref.tensors:
        if t.tensor_type not in seen_types:
            seen_types.add(t.tensor_type)
            picked[t.name] = t
    assert len(seen_types) >= 2
    for name, t in picked.items():
        want = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        got = ours.tensor_bytes(name)
        assert got.dtype == torch.uint8 and got.ndim == 1
        assert got.numel() == t.n_bytes, name
        assert np.array_equal(got.numpy(), want), name


# --- files written with GGUFWriter ---------------------------------------------------------


def _write(path, kv=(), tensors=(), alignment=None, arch="llama"):
    w = GGUFWriter(str(path), arch=arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, val, vtype, sub in kv:
        w.add_key_value(key, val, vtype, sub_type=sub)
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_F32_TENTH = float(np.float32(0.1))  # what a float32 0.1 reads back as

# (key, value written, vtype, sub_type, expected python value, expected type/dtype)
_ROUND_TRIP = [
    ("t.u8", 255, V.UINT8, None, 255, int),
    ("t.i8", -128, V.INT8, None, -128, int),
    ("t.u16", 65535, V.UINT16, None, 65535, int),
    ("t.i16", -32768, V.INT16, None, -32768, int),
    ("t.u32", 2**32 - 1, V.UINT32, None, 2**32 - 1, int),
    ("t.i32", -(2**31), V.INT32, None, -(2**31), int),
    ("t.u64", 2**64 - 1, V.UINT64, None, 2**64 - 1, int),
    ("t.i64", -(2**63), V.INT64, None, -(2**63), int),
    ("t.f32", 0.1, V.FLOAT32, None, _F32_TENTH, float),
    ("t.f32_neg", -2.5, V.FLOAT32, None, -2.5, float),
    ("t.f64", 0.1, V.FLOAT64, None, 0.1, float),
    ("t.bool_t", True, V.BOOL, None, True, bool),
    ("t.bool_f", False, V.BOOL, None, False, bool),
    ("t.str", "héllo ✓ 漢字 🙂", V.STRING, None, "héllo ✓ 漢字 🙂", str),
    ("t.str_empty", "", V.STRING, None, "", str),
    ("t.a_u8", [0, 7, 255], V.ARRAY, V.UINT8, [0, 7, 255], np.uint8),
    ("t.a_i8", [-128, 0, 127], V.ARRAY, V.INT8, [-128, 0, 127], np.int8),
    ("t.a_u16", [0, 65535], V.ARRAY, V.UINT16, [0, 65535], np.uint16),
    ("t.a_i16", [-32768, 32767], V.ARRAY, V.INT16, [-32768, 32767], np.int16),
    ("t.a_u32", [1, 2**32 - 1], V.ARRAY, V.UINT32, [1, 2**32 - 1], np.uint32),
    ("t.a_i32", [-(2**31), 2**31 - 1, 3], V.ARRAY, V.INT32, [-(2**31), 2**31 - 1, 3], np.int32),
    ("t.a_u64", [2**64 - 1, 0], V.ARRAY, V.UINT64, [2**64 - 1, 0], np.uint64),
    ("t.a_i64", [-(2**63), 2**63 - 1], V.ARRAY, V.INT64, [-(2**63), 2**63 - 1], np.int64),
    ("t.a_f32", [0.1, -2.5, 1e30], V.ARRAY, V.FLOAT32, [_F32_TENTH, -2.5, float(np.float32(1e30))], np.float32),
    ("t.a_f64", [0.1, -1e300], V.ARRAY, V.FLOAT64, [0.1, -1e300], np.float64),
    ("t.a_bool", [True, False, True], V.ARRAY, V.BOOL, [True, False, True], np.bool_),
    ("t.a_str", ["a", "", "ü漢", "x y"], V.ARRAY, V.STRING, ["a", "", "ü漢", "x y"], list),
]


def test_every_metadata_type_round_trips(tmp_path):
    kv = [(k, v, t, s) for k, v, t, s, _, _ in _ROUND_TRIP]
    kv.append(("t.nested", [[1, 2, 3], [-4]], V.ARRAY, V.ARRAY))
    kv.append(("t.nested_str", [["a", "bc"], ["d"]], V.ARRAY, V.ARRAY))
    path = _write(tmp_path / "types.gguf", kv)
    with GGUFFile(path) as f:
        assert f.version == 3
        assert f.architecture == "llama"
        assert f.tensors == {}
        for key, _, vtype, _, want, typ in _ROUND_TRIP:
            got = f.require(key)
            if vtype == V.ARRAY and typ is not list:
                assert isinstance(got, np.ndarray) and got.dtype == np.dtype(typ), (key, got)
                assert got.tolist() == want, key
            else:
                assert type(got) is typ and got == want, (key, got, want)
        nested = f.require("t.nested")
        assert len(nested) == 2
        assert [a.dtype for a in nested] == [np.dtype(np.int32)] * 2  # inner type from GGUFWriter: INT32
        assert [a.tolist() for a in nested] == [[1, 2, 3], [-4]]
        assert f.require("t.nested_str") == [["a", "bc"], ["d"]]
        # exactly the keys written (plus the architecture GGUFWriter adds)
        assert set(f.metadata) == {"general.architecture", "t.nested", "t.nested_str"} | {k for k, *_ in _ROUND_TRIP}


def test_tensors_round_trip_with_custom_alignment(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((7,)).astype(np.float16)
    c = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    path = _write(tmp_path / "t.gguf", [("x.k", 1, V.UINT32, None)], [("a", a), ("b", b), ("c", c)], alignment=64)
    with GGUFFile(path) as f:
        assert f.require("general.alignment") == 64
        assert f.data_offset % 64 == 0
        for name, arr, gtype in (("a", a, GGMLQuantizationType.F32), ("b", b, GGMLQuantizationType.F16),
                                 ("c", c, GGMLQuantizationType.F32)):
            info = f.tensor_info(name)
            assert info.shape == arr.shape and info.ggml_type == gtype and info.nbytes == arr.nbytes
            assert info.offset % 64 == 0
            assert f.tensor_bytes(name).numpy().tobytes() == arr.tobytes()


# --- damaged files ---------------------------------------------------------------------------


def _small_file(tmp_path):
    kv = [
        ("s.u32", 7, V.UINT32, None),
        ("s.arr", [1, 2, 3, 4], V.ARRAY, V.UINT32),
        ("s.strs", ["ab", "cde", "f"], V.ARRAY, V.STRING),
        ("s.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY),
    ]
    return _write(tmp_path / "small.gguf", kv, [("w", np.arange(12, dtype=np.float32).reshape(3, 4))])


def test_bad_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(p)
    p.write_bytes(b"GG")  # shorter than the magic
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        GGUFFile(p)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFFormatError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    data = bytearray(_small_file(tmp_path).read_bytes())
    data[4:8] = struct.pack("<I", version)
    p = tmp_path / "v.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match=f"version {version}"):
        GGUFFile(p)


def test_version_2_is_read(tmp_path):
    data = bytearray(_small_file(tmp_path).read_bytes())
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 share the layout
    p = tmp_path / "v2.gguf"
    p.write_bytes(bytes(data))
    with GGUFFile(p) as f:
        assert f.version == 2 and f.require("s.u32") == 7


def test_truncated_tensor_data(tmp_path):
    src = _small_file(tmp_path)
    ref = GGUFReader(src)
    end = ref.tensors[0].data_offset + ref.tensors[0].n_bytes
    data = src.read_bytes()
    assert len(data) >= end
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: end - 1])  # one byte short of the tensor's last byte
    with pytest.raises(GGUFFormatError, match="runs past the end") as exc:
        GGUFFile(p)
    assert "'w'" in str(exc.value) and "truncated" in str(exc.value)
    p.write_bytes(data[:end])  # the tensor complete (only trailing padding cut) is fine
    with GGUFFile(p) as f:
        assert np.array_equal(f.tensor_bytes("w").numpy().view(np.float32), np.arange(12, dtype=np.float32))


def test_every_truncation_raises_gguf_format_error(tmp_path):
    """Cutting the file anywhere before the end of the tensor data must raise GGUFFormatError
    (never a numpy ValueError / struct.error / silently short arrays)."""
    src = _small_file(tmp_path)
    ref = GGUFReader(src)
    end = ref.tensors[0].data_offset + ref.tensors[0].n_bytes
    data = src.read_bytes()
    p = tmp_path / "cut.gguf"
    for cut in range(end):
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFFile(p)


def test_truncated_metadata_only_file(tmp_path):
    """No tensors: a cut inside the last (string) array must still be noticed."""
    src = _write(tmp_path / "meta.gguf", [("m.strs", ["abc", "defg", "hi"], V.ARRAY, V.STRING)])
    data = src.read_bytes()
    with GGUFFile(src) as f:
        assert f.require("m.strs") == ["abc", "defg", "hi"]
    # GGUFWriter pads the header to the alignment; the array ends at the last non-zero byte.
    last = len(data.rstrip(b"\x00"))
    p = tmp_path / "cut.gguf"
    for cut in range(last):
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFFile(p)


def test_bad_alignment(tmp_path):
    path = _write(tmp_path / "a.gguf", [("general.alignment", 0, V.UINT32, None)],
                  [("w", np.zeros(4, dtype=np.float32))])
    with pytest.raises(GGUFFormatError, match="alignment"):
        GGUFFile(path)


def test_missing_metadata_and_tensor(tmp_path):
    with GGUFFile(_small_file(tmp_path)) as f:
        with pytest.raises(MissingMetadataError, match=r"missing\.key") as exc:
            f.require("missing.key")
        assert exc.value.key == "missing.key"
        assert f.get("missing.key", 5) == 5
        with pytest.raises(MissingTensorError, match="'nope'") as exc:
            f.tensor_info("nope")
        assert exc.value.tensor == "nope"
        with pytest.raises(MissingTensorError):
            f.tensor_bytes("nope")
        assert isinstance(exc.value, MinivllmError)
