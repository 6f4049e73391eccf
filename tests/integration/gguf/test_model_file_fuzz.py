"""Hostile GGUF files: every field crafted with `struct`, then read through the real load path.

A model file is downloaded input. Whatever its bytes say, opening it must end in one of
minivllm's own errors (a `GGUFFormatError` for the container, `InvalidMetadataError` for a
value of the wrong type or range, ...) whose message names the field, and must never
allocate memory in proportion to a count or length *read from* the file: the header can
claim 2**62 tensors in a 100-byte file. Each case here runs under a memory bound
(tracemalloc peak and max-RSS growth).

tests/integration/gguf/test_gguf_reader.py already covers bad magic, empty/missing files, truncation at
every offset, unsupported versions and a zero alignment; this file does not repeat them.

* `RawGGUF` writes GGUF v3 byte by byte (no gguf-py), so counts, lengths, type ids, dims
  and offsets can be anything; it also records where each structural field lies, for the
  mutation fuzz at the end.
* `tiny_model` writes a complete, loadable 1-layer Llama with it (checked by generating
  tokens through `minivllm.LLM`); the wrong-type-metadata cases change one key of it.
"""

from __future__ import annotations

import random
import resource
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from synthetic_gguf import tiny_vocab

from minivllm.errors import GGUFFormatError, InvalidMetadataError, MinivllmError
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.model.config import ModelConfig
from minivllm.model.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
# ggml tensor types used here
GGML_F32, GGML_Q4_0 = 0, 2

MEMORY_LIMIT = 64 * 2**20  # bytes: far above what these tiny files need, far below 2**60
RSS_LIMIT = 256 * 2**20


# --- writing GGUF by hand -----------------------------------------------------------------


def _str(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def encode_value(vtype: int, value, etype: int | None = None) -> bytes:
    """The bytes of a metadata value (without the u32 type), GGUF little-endian."""
    if vtype in _FMT:
        return struct.pack("<" + _FMT[vtype], value)
    if vtype == STR:
        return _str(value)
    assert vtype == ARR and etype is not None
    # An element of a nested array (etype == ARR) is (its element type, its values).
    body = b"".join(encode_value(ARR, v[1], v[0]) if etype == ARR else encode_value(etype, v) for v in value)
    return struct.pack("<IQ", etype, len(value)) + body


class RawGGUF:
    """A GGUF v3 file assembled from raw fields.

    `kv(key, vtype, value)` / `kv_raw(key, vtype, payload)` add metadata; `tensor(...)`
    adds a tensor info (with data, or with a forced offset and no data). `build()`
    returns the bytes and fills `fields`: (offset, size) of every count, length, type id,
    dim and offset field, which the mutation fuzz aims at.
    """

    def __init__(self, alignment: int = 32):
        self.alignment = alignment
        self.kvs: list[tuple[bytes, int, bytes]] = []
        self.tensors: list[tuple[bytes, list[int], int, int | None, bytes]] = []
        self.n_kv: int | None = None
        self.n_tensors: int | None = None
        self.fields: list[tuple[int, int]] = []

    def kv(self, key: str, vtype: int, value, etype: int | None = None) -> "RawGGUF":
        return self.kv_raw(key, vtype, encode_value(vtype, value, etype))

    def kv_raw(self, key: str | bytes, vtype: int, payload: bytes) -> "RawGGUF":
        self.kvs.append((key.encode() if isinstance(key, str) else key, vtype, payload))
        return self

    def tensor(self, name: str, dims: list[int], ggml_type: int = GGML_F32, data: bytes = b"",
               offset: int | None = None) -> "RawGGUF":
        """`dims` in ggml order (row length first). `offset=None`: placed after the previous tensor."""
        self.tensors.append((name.encode(), list(dims), ggml_type, offset, data))
        return self

    def build(self) -> bytes:
        out = bytearray(b"GGUF")
        fields = self.fields = []

        def put(fmt: str, *values) -> None:
            fields.append((len(out), struct.calcsize(fmt)))
            out.extend(struct.pack(fmt, *values))

        put("<I", 3)
        put("<Q", len(self.tensors) if self.n_tensors is None else self.n_tensors)
        put("<Q", len(self.kvs) if self.n_kv is None else self.n_kv)
        for key, vtype, payload in self.kvs:
            put("<Q", len(key))
            out.extend(key)
            put("<I", vtype)
            if vtype in (STR, ARR):
                fields.append((len(out), 12 if vtype == ARR else 8))  # element type + count / length
            out.extend(payload)
        data = bytearray()
        for name, dims, gtype, offset, blob in self.tensors:
            if offset is None:
                data.extend(b"\0" * (-len(data) % self.alignment))
                offset = len(data)
                data.extend(blob)
            put("<Q", len(name))
            out.extend(name)
            put("<I", len(dims))
            for d in dims:
                put("<Q", d)
            put("<I", gtype)
            put("<Q", offset)
        out.extend(b"\0" * (-len(out) % self.alignment))
        return bytes(out + data)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.build())
        return path


def f32_bytes(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


# A tiny but complete Llama: 1 layer, d_model 32, 4 heads (2 KV heads), vocab 300.
D, FF, HEADS, KV_HEADS, VOCAB = 32, 64, 4, 2, 300
HEAD_DIM = D // HEADS


def model_metadata() -> dict[str, tuple]:
    """key -> (vtype, value[, etype]) of the tiny model, in file order."""
    tokens, types, merges = tiny_vocab(VOCAB)
    eos = tokens.index("<|endoftext|>")
    return {
        "general.architecture": (STR, "llama"),
        "general.name": (STR, "tiny-raw"),
        "llama.context_length": (U32, 256),
        "llama.embedding_length": (U32, D),
        "llama.block_count": (U32, 1),
        "llama.feed_forward_length": (U32, FF),
        "llama.attention.head_count": (U32, HEADS),
        "llama.attention.head_count_kv": (U32, KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "llama.rope.freq_base": (F32, 10000.0),
        "llama.rope.dimension_count": (U32, HEAD_DIM),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.pre": (STR, "llama-bpe"),
        "tokenizer.ggml.tokens": (ARR, tokens, STR),
        "tokenizer.ggml.token_type": (ARR, types, I32),
        "tokenizer.ggml.merges": (ARR, merges, STR),
        "tokenizer.ggml.bos_token_id": (U32, eos),
        "tokenizer.ggml.eos_token_id": (U32, eos),
        "tokenizer.ggml.add_bos_token": (BOOL, True),
        "tokenizer.chat_template": (STR, "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"),
    }


def model_tensors() -> list[tuple[str, list[int], bytes]]:
    """(name, ggml dims, F32 bytes) of the tiny model; dims are (cols, rows)."""
    rng = np.random.default_rng(0)

    def w(rows: int, cols: int) -> tuple[list[int], bytes]:
        return [cols, rows], f32_bytes(rng.normal(0, 0.08, (rows, cols)))

    def norm(n: int) -> tuple[list[int], bytes]:
        return [n], f32_bytes(1 + 0.1 * rng.standard_normal(n))

    kv = KV_HEADS * HEAD_DIM
    return [
        ("token_embd.weight", *w(VOCAB, D)),
        ("blk.0.attn_norm.weight", *norm(D)),
        ("blk.0.attn_q.weight", *w(D, D)),
        ("blk.0.attn_k.weight", *w(kv, D)),
        ("blk.0.attn_v.weight", *w(kv, D)),
        ("blk.0.attn_output.weight", *w(D, D)),
        ("blk.0.ffn_norm.weight", *norm(D)),
        ("blk.0.ffn_gate.weight", *w(FF, D)),
        ("blk.0.ffn_up.weight", *w(FF, D)),
        ("blk.0.ffn_down.weight", *w(D, FF)),
        ("output_norm.weight", *norm(D)),
    ]


def tiny_model(path: Path, *, override: dict[str, tuple] | None = None, drop: tuple[str, ...] = (),
               tensors: list[tuple[str, list[int], bytes]] | None = None) -> RawGGUF:
    """Write the tiny model with some keys replaced (`override`) or removed (`drop`)."""
    meta = model_metadata() | (override or {})
    g = RawGGUF()
    for key, spec in meta.items():
        if key not in drop:
            g.kv(key, *spec)
    for name, dims, blob in model_tensors() if tensors is None else tensors:
        g.tensor(name, dims, GGML_F32, blob)
    g.write(path)
    return g


def load_everything(path: Path):
    """What `minivllm.LLM` does with a file, minus the engine: open, tokenizer, model."""
    gf = GGUFFile(path)
    tok = Tokenizer.from_gguf(gf)
    model = load_model(gf, torch.device("cpu"), torch.float32, progress=False)
    return gf, tok, model


# --- memory bound ---------------------------------------------------------------------------


@contextmanager
def bounded_memory(limit: int = MEMORY_LIMIT):
    """Fail if the block's Python/numpy allocations peak above `limit`, or the process's
    max RSS grows by more than RSS_LIMIT (catches allocations tracemalloc cannot see)."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        assert peak < limit, f"peak traced allocation {peak / 2**20:.1f} MiB"
        assert rss_growth < RSS_LIMIT, f"max RSS grew by {rss_growth / 2**20:.1f} MiB"


def expect_error(path: Path, *needles: str, error: type[Exception] = GGUFFormatError, load=GGUFFile) -> str:
    """`load(path)` raises `error` (not IndexError/struct.error/MemoryError/...) within the
    memory bound; its message contains every needle. Returns the message."""
    with bounded_memory():
        with pytest.raises(error) as info:
            load(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert str(path) in message or "tokenizer.chat_template" in message, message
    return message


# --- the builder itself -----------------------------------------------------------------------


def test_raw_builder_matches_gguf_py(tmp_path):
    """The hand-written bytes are real GGUF: gguf-py's reader agrees with ours."""
    g = (RawGGUF().kv("a.u32", U32, 7).kv("a.str", STR, "héllo").kv("a.strs", ARR, ["x", "", "yz"], STR)
         .kv("a.f32s", ARR, [0.5, -2.0], F32).kv("a.nested", ARR, [(I32, [1, 2]), (I32, [3])], ARR)
         .tensor("w", [4, 3], GGML_F32, f32_bytes(np.arange(12))).tensor("b", [5], GGML_F32, f32_bytes(np.ones(5))))
    path = g.write(tmp_path / "raw.gguf")
    ref = GGUFReader(path)
    with GGUFFile(path) as f:
        assert f.metadata["a.u32"] == 7 and f.metadata["a.str"] == "héllo" and f.metadata["a.strs"] == ["x", "", "yz"]
        assert f.metadata["a.f32s"].tolist() == [0.5, -2.0]
        assert [a.tolist() for a in f.metadata["a.nested"]] == [[1, 2], [3]]
        for t in ref.tensors:
            info = f.tensor_info(t.name)
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            assert f.tensor_bytes(t.name).numpy().tobytes() == np.asarray(t.data).tobytes()
        assert f.tensor_info("w").shape == (3, 4)


def test_tiny_raw_model_generates(tmp_path):
    """The fixture model is complete: the public API loads it, generates and chats."""
    from minivllm import LLM, SamplingParams

    path = tmp_path / "tiny.gguf"
    tiny_model(path)
    llm = LLM(model=str(path), device="cpu", dtype="float32", progress=False, kv_memory_bytes=2**20)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert llm.chat_prompt([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"


# --- absurd counts and lengths ------------------------------------------------------------------


@pytest.mark.parametrize("n_tensors,n_kv,needle", [
    (2**62, 0, "n_tensors=4611686018427387904"),
    (0, 2**62, "n_kv=4611686018427387904"),
    (2**64 - 1, 2**64 - 1, "n_kv=18446744073709551615"),
    (1000, 0, "n_tensors=1000"),  # modest, but 24 kB of tensor infos cannot fit in this file
])
def test_absurd_header_counts(tmp_path, n_tensors, n_kv, needle):
    g = RawGGUF().kv("general.architecture", STR, "llama")
    g.n_tensors, g.n_kv = n_tensors, n_kv
    msg = expect_error(g.write(tmp_path / "c.gguf"), needle, "bytes after the header")
    assert "corrupt" in msg  # and the fix: download or convert it again


@pytest.mark.parametrize("etype,width", [(U8, 1), (U32, 4), (F64, 8), (STR, 8), (ARR, 12)])
def test_array_count_2_60(tmp_path, etype, width):
    """An array claiming 2**60 elements, whatever their type, is refused before any allocation."""
    payload = struct.pack("<IQ", etype, 2**60) + b"\0" * 64
    path = RawGGUF().kv_raw("big.array", ARR, payload).write(tmp_path / "a.gguf")
    expect_error(path, "'big.array'", f"array count {2**60}", f"needs at least {2**60 * width} bytes")


def test_string_value_length_2_60(tmp_path):
    path = RawGGUF().kv_raw("big.string", STR, _str(b"abc", length=2**60)).write(tmp_path / "s.gguf")
    expect_error(path, "'big.string'", f"string length {2**60}", "runs past the end")


def test_key_length_2_60(tmp_path):
    path = RawGGUF().kv_raw(b"", U32, b"").write(tmp_path / "k.gguf")
    data = bytearray(path.read_bytes())
    data[24:32] = struct.pack("<Q", 2**60)  # the first key's length
    path.write_bytes(bytes(data))
    expect_error(path, "metadata entry #0", f"string length {2**60}")


def test_string_array_element_length_2_60(tmp_path):
    payload = struct.pack("<IQ", STR, 3) + _str("ok") + _str(b"x", length=2**60) + _str("z")
    path = RawGGUF().kv_raw("tok.list", ARR, payload).write(tmp_path / "e.gguf")
    expect_error(path, "'tok.list'", f"(length {2**60})", "runs past the end")


def test_tensor_name_length_2_60(tmp_path):
    g = RawGGUF().tensor("w", [4], GGML_F32, f32_bytes(np.zeros(4)))
    path = g.write(tmp_path / "n.gguf")
    data = bytearray(path.read_bytes())
    data[24:32] = struct.pack("<Q", 2**60)  # the first tensor name's length (no metadata)
    path.write_bytes(bytes(data))
    expect_error(path, "tensor info #0", f"string length {2**60}")


def test_nested_arrays(tmp_path):
    """Nested arrays read back (gguf allows them), but not nested without limit: 10k levels
    of `[[[...]]]` in 120 kB would otherwise be a RecursionError."""
    value = [(ARR, [(U8, [1, 2])])]
    path = RawGGUF().kv("n.ok", ARR, value, ARR).write(tmp_path / "ok.gguf")
    with GGUFFile(path) as f:
        assert [[x.tolist() for x in inner] for inner in f.metadata["n.ok"]] == [[[1, 2]]]

    deep = b"".join(struct.pack("<IQ", ARR, 1) for _ in range(10_000)) + struct.pack("<IQ", U8, 0)
    path = RawGGUF().kv_raw("n.deep", ARR, deep).write(tmp_path / "deep.gguf")
    expect_error(path, "'n.deep'", "nested more than")


# --- absurd tensor shapes ----------------------------------------------------------------------


def _one_tensor(tmp_path, dims, ggml_type=GGML_F32, data=b"\0" * 64, offset=None, name="w") -> Path:
    return RawGGUF().tensor(name, dims, ggml_type, data, offset).write(tmp_path / "t.gguf")


@pytest.mark.parametrize("n_dims", [5, 1000, 2**32 - 1])
def test_too_many_dims(tmp_path, n_dims):
    path = _one_tensor(tmp_path, [1])
    data = bytearray(path.read_bytes())
    at = 24 + 8 + 1  # header, name length, name "w"
    data[at:at + 4] = struct.pack("<I", n_dims)
    path.write_bytes(bytes(data))
    expect_error(path, "'w'", f"n_dims={n_dims}", "at most 4 dimensions")


def test_huge_dim_runs_past_the_end(tmp_path):
    expect_error(_one_tensor(tmp_path, [2**62]), "'w'", "runs past the end", "offset")


@pytest.mark.parametrize("dims", [[2**32, 2**32], [2**62, 4], [2**21] * 4])
def test_element_count_overflows_int64(tmp_path, dims):
    expect_error(_one_tensor(tmp_path, dims), "'w'", "overflows int64")


@pytest.mark.parametrize("dim", [2**63, 2**64 - 1, 2**64 - 32])
def test_negative_looking_dim(tmp_path, dim):
    """A uint64 above INT64_MAX is a negative ggml ne[]: llama.cpp refuses it, so do we."""
    expect_error(_one_tensor(tmp_path, [4, dim]), "'w'", f"dimension {dim}", "negative")


def test_zero_dim_is_an_empty_tensor_but_not_a_model(tmp_path):
    """ggml allows zero-size tensors (reader: 0 bytes); a model's embedding cannot be one."""
    with GGUFFile(_one_tensor(tmp_path, [0, 8])) as f:
        assert f.tensor_info("w").nbytes == 0 and f.tensor_bytes("w").numel() == 0
    tensors = [(n, [D, 0] if n == "token_embd.weight" else dims, b"" if n == "token_embd.weight" else blob)
               for n, dims, blob in model_tensors()]
    path = tmp_path / "m.gguf"
    tiny_model(path, tensors=tensors)
    expect_error(path, "token_embd.weight", "(0, 32)", load=lambda p: ModelConfig.from_gguf(GGUFFile(p)))


def test_row_not_a_whole_number_of_blocks(tmp_path):
    expect_error(_one_tensor(tmp_path, [33, 2], GGML_Q4_0), "'w'", "row length 33", "Q4_0 block size 32")


# --- tensor data offsets --------------------------------------------------------------------------


def test_offset_beyond_the_end_of_the_file(tmp_path):
    expect_error(_one_tensor(tmp_path, [4], offset=2**40), "'w'", f"data offset {2**40}", "runs past the end")


def test_offset_not_aligned(tmp_path):
    expect_error(_one_tensor(tmp_path, [4], offset=4), "'w'", "data offset 4", "general.alignment=32")


def test_offset_plus_size_overflows(tmp_path):
    """In uint64 arithmetic offset + size wraps to a small number; it must not pass a bounds check."""
    offset = 2**64 - 32  # aligned; + 64 bytes wraps around
    expect_error(_one_tensor(tmp_path, [16], offset=offset), "'w'", f"data offset {offset}", "runs past the end")


@pytest.mark.parametrize("b_offset", [0, 32])
def test_overlapping_tensors(tmp_path, b_offset):
    g = (RawGGUF().tensor("a", [16], GGML_F32, f32_bytes(np.zeros(16)), offset=0)
         .tensor("b", [16], GGML_F32, b"", offset=b_offset))
    data = g.build() + b"\0" * 256  # room for both: only the overlap is wrong
    path = tmp_path / "o.gguf"
    path.write_bytes(data)
    expect_error(path, "'a'", "'b'", "overlap", f"data offset {b_offset}")


def test_adjacent_tensors_do_not_overlap(tmp_path):
    g = RawGGUF().tensor("a", [8], GGML_F32, f32_bytes(np.ones(8))).tensor("b", [8], GGML_F32, f32_bytes(np.ones(8)))
    with GGUFFile(g.write(tmp_path / "ok.gguf")) as f:
        assert f.tensor_info("b").offset == f.tensor_info("a").offset + 32


# --- unknown type ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_id", [9999, 2**32 - 1, 4])  # 4 = the removed Q4_2
def test_unknown_ggml_type(tmp_path, type_id):
    expect_error(_one_tensor(tmp_path, [32], type_id), "'w'", f"unknown ggml type id {type_id}")


@pytest.mark.parametrize("vtype", [13, 99, 2**32 - 1])
def test_unknown_metadata_value_type(tmp_path, vtype):
    path = RawGGUF().kv_raw("odd.value", vtype, b"\0" * 16).write(tmp_path / "v.gguf")
    expect_error(path, "'odd.value'", f"unknown metadata value type {vtype}")


@pytest.mark.parametrize("count", [0, 3])
def test_unknown_array_element_type(tmp_path, count):
    """Refused even when the array is empty (nothing would be read, but the file is wrong)."""
    path = RawGGUF().kv_raw("odd.array", ARR, struct.pack("<IQ", 99, count) + b"\0" * 16).write(tmp_path / "e.gguf")
    expect_error(path, "'odd.array'", "unknown element type 99")


# --- duplicates -------------------------------------------------------------------------------------


def test_duplicate_metadata_key(tmp_path):
    path = RawGGUF().kv("llama.block_count", U32, 1).kv("llama.block_count", U32, 99).write(tmp_path / "d.gguf")
    expect_error(path, "duplicate metadata key 'llama.block_count'")


def test_duplicate_tensor_name(tmp_path):
    g = RawGGUF().tensor("w", [8], GGML_F32, f32_bytes(np.ones(8))).tensor("w", [8], GGML_F32, f32_bytes(np.ones(8)))
    expect_error(g.write(tmp_path / "d.gguf"), "duplicate tensor name 'w'")


# --- metadata of the wrong type or range, through the real load path ------------------------------

_WRONG = [
    # (key, replacement spec, substring of the complaint)
    ("llama.context_length", (STR, "4096"), "is the string '4096', expected an integer"),
    ("llama.block_count", (F32, 1.0), "is the number 1.0, expected an integer"),
    ("llama.block_count", (BOOL, True), "is the bool True, expected an integer"),
    ("llama.embedding_length", (ARR, [32], U32), "expected an integer"),
    ("llama.attention.layer_norm_rms_epsilon", (STR, "1e-5"), "expected a number"),
    ("llama.rope.freq_base", (BOOL, True), "expected a number"),
    ("general.architecture", (U32, 7), "is the number 7, expected a string"),
    ("general.alignment", (STR, "32"), "expected an integer"),
    ("tokenizer.ggml.model", (U32, 2), "expected a string"),
    ("tokenizer.ggml.pre", (ARR, ["llama-bpe"], STR), "expected a string"),
    ("tokenizer.ggml.tokens", (ARR, list(range(VOCAB)), I32), "expected an array of strings"),
    ("tokenizer.ggml.tokens", (STR, "abc"), "expected an array of strings"),
    ("tokenizer.ggml.merges", (U32, 5), "expected an array of strings"),
    ("tokenizer.ggml.token_type", (ARR, ["1"] * VOCAB, STR), "expected an array of integers"),
    (
        "tokenizer.ggml.token_type",
        (ARR, [1] * (VOCAB + 5), I32),
        f"expected one per token of tokenizer.ggml.tokens ({VOCAB})",
    ),
    ("tokenizer.ggml.bos_token_id", (STR, "1"), "expected an integer"),
    ("tokenizer.ggml.add_bos_token", (STR, "false"), "expected a bool"),
    ("tokenizer.chat_template", (U32, 1), "expected a string"),
    # right type, impossible value
    ("llama.attention.head_count", (U32, 0), "is 0, expected a positive integer"),
    ("llama.block_count", (I32, -1), "is -1, expected a positive integer"),
    ("llama.attention.head_count_kv", (U32, 3), "expected a divisor of llama.attention.head_count=4"),
    ("llama.rope.dimension_count", (U64, 2**40), "expected an even number <= head_dim=8"),
    ("llama.attention.layer_norm_rms_epsilon", (F32, float("nan")), "expected a positive finite number"),
    ("llama.context_length", (I64, -(2**63)), "expected a positive integer"),
    ("general.alignment", (U32, 48), "expected a power of two"),
]


@pytest.mark.parametrize("key,spec,complaint", _WRONG, ids=[f"{k}={s[0]}:{s[1]!r:.12}" for k, s, _ in _WRONG])
def test_wrong_metadata_type_through_load_path(tmp_path, key, spec, complaint):
    """`LLM(model=path)` → InvalidMetadataError naming the key and what was expected."""
    from minivllm import LLM

    path = tmp_path / "m.gguf"
    tiny_model(path, override={key: spec})
    message = expect_error(path, f"metadata key {key!r}", complaint, error=InvalidMetadataError,
                           load=lambda p: LLM(model=str(p), device="cpu", dtype="float32", progress=False))
    assert "Re-download it, or re-convert it" in message


def test_wrong_metadata_type_through_model_config(tmp_path):
    """The same checks when only ModelConfig reads the file (no tokenizer involved)."""
    path = tmp_path / "m.gguf"
    tiny_model(path, override={"llama.feed_forward_length": (STR, "64")})
    with pytest.raises(InvalidMetadataError) as info:
        ModelConfig.from_gguf(GGUFFile(path))
    assert info.value.key == "llama.feed_forward_length" and "expected an integer" in str(info.value)


def test_rope_freqs_of_the_wrong_shape(tmp_path):
    """A tensor the config does not size by itself still gets its shape checked."""
    tensors = model_tensors() + [("rope_freqs.weight", [7], f32_bytes(np.ones(7)))]
    path = tmp_path / "m.gguf"
    tiny_model(path, tensors=tensors)
    expect_error(path, "'rope_freqs.weight'", "expected (4,)", load=load_everything)


# --- seeded mutation fuzz ------------------------------------------------------------------------------

_INTERESTING_U64 = [0, 1, 2**31, 2**32 - 1, 2**32, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]
_INTERESTING_U32 = [0, 1, 3, 8, 9, 12, 13, 30, 39, 99, 9999, 2**31, 2**32 - 1]


def _mutate(data: bytes, fields: list[tuple[int, int]], header_end: int, rng: random.Random) -> tuple[bytes, str]:
    buf = bytearray(data)
    kind = rng.choice(("bit", "byte", "field", "field", "field"))
    if kind == "field":  # a count, length, type id, dim or offset: the dangerous fields
        at, size = rng.choice(fields)
        if size == 12:  # array element type + count
            if rng.random() < 0.5:
                at, size = at + 4, 8
            else:
                size = 4
        value = rng.choice(_INTERESTING_U64 if size == 8 else _INTERESTING_U32 + [rng.randrange(2**32)])
        if size == 8 and rng.random() < 0.3:
            value = rng.randrange(2**64)
        buf[at:at + size] = struct.pack("<Q" if size == 8 else "<I", value % 2 ** (8 * size))
        return bytes(buf), f"field@{at}:{size}={value}"
    at = rng.randrange(4, header_end)
    if kind == "bit":
        buf[at] ^= 1 << rng.randrange(8)
    else:
        buf[at] = rng.randrange(256)
    return bytes(buf), f"{kind}@{at}"


def test_seeded_header_mutations_raise_only_minivllm_errors(tmp_path):
    """400 damaged copies of the tiny model, each opened like `LLM` does: success, or a
    MinivllmError; never another exception, never a large allocation."""
    base_path = tmp_path / "base.gguf"
    g = tiny_model(base_path)
    base = base_path.read_bytes()
    with GGUFFile(base_path) as f:
        header_end = f.data_offset
    rng = random.Random(20240917)
    path = tmp_path / "mutant.gguf"
    outcomes: dict[str, int] = {}
    for case in range(400):
        data, how = _mutate(base, g.fields, header_end, rng)
        path.write_bytes(data)
        try:
            with bounded_memory():
                try:
                    load_everything(path)
                    outcome = "loaded"
                except MinivllmError as exc:
                    outcome = type(exc).__name__
        except AssertionError as exc:
            raise AssertionError(f"case {case} ({how}): {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"case {case} ({how}) escaped as {type(exc).__name__}: {exc}") from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # The fuzz reaches both outcomes and more than one kind of error.
    assert outcomes.get("loaded", 0) > 0 and outcomes.get("GGUFFormatError", 0) > 20, outcomes
    assert len(outcomes) >= 3, outcomes
