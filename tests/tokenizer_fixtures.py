r"""Shared by tests/integration/gguf/test_tokenizer.py and scripts/record_llamacpp_token_ids.py.

Kept free of torch and minivllm imports: the recording script runs it under the
scratch llama-cpp-python virtualenv, which has only numpy and gguf.

* `tokenizer_metadata_sha256`: a fingerprint of every `tokenizer.*` key, computed the
  same way from either GGUF reader, so a test can tell that the vocabulary it is
  checking is the one the reference ids were recorded from.
* `write_synthetic_vocab_gguf`: a tensor-less GGUF that reuses a real byte-level BPE
  vocabulary but names another pre-tokenizer. No small real model ships `llama-bpe`,
  `gpt-2` or `default`, and llama.cpp needs only the metadata to tokenize
  (`vocab_only=True` never touches tensors).

The SmolLM2 and Qwen2 vocabularies have no multi-digit tokens (both split digits
before BPE), so on them the pre-tokenizers' different digit rules (`\p{N}` vs
`\p{N}{1,3}` vs `\p{N}+` then `[0-9]{3}`) would give identical ids. The synthetic
vocabulary therefore appends every 2-digit token with a merge ("1 2") and every
3-digit token *without* a merge: "123" then comes out as one token only through
llama.cpp's `ignore_merges` (Llama 3), as "12" + "3" through merges, and digit runs
group differently under each regex.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_PATH = REPO_ROOT / "data" / "tokenizer_corpus.json"
REFERENCE_DIR = REPO_ROOT / "data" / "tokenizer_reference"

# Pre-tokenizer names that get a synthetic file (on the SmolLM2 vocabulary), and the
# reference file each one's ids are stored in.
SYNTHETIC_PRES = ("llama-bpe", "gpt-2", "default")


def synthetic_reference_name(pre: str) -> str:
    return f"{pre}-synthetic.llamacpp.json"


def load_corpus() -> dict[str, Any]:
    return json.loads(CORPUS_PATH.read_text(encoding="utf-8"))


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def tokenizer_metadata_sha256(metadata: Mapping[str, Any]) -> str:
    """SHA-256 over all `tokenizer.*` keys and their values, in a reader-independent form."""
    plain = {k: _plain(v) for k, v in metadata.items() if k.startswith("tokenizer.")}
    blob = json.dumps(plain, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def write_synthetic_vocab_gguf(path: str | Path, pre: str, source: Mapping[str, Any]) -> Path:
    """Write a vocab-only GGUF: `source`'s tokens, types, merges and BOS/EOS (plus the
    digit tokens described above), with `tokenizer.ggml.pre = pre`.

    `source` is a metadata mapping (tokens as list[str], token types as ints). The file
    deliberately has no `tokenizer.ggml.add_bos_token`, so llama.cpp's per-pre default
    (BOS for llama-bpe, none for gpt-2/default) is what gets recorded and tested.
    Deterministic: the same source and gguf version give the same bytes.
    """
    import gguf  # only needed here; keeps the module importable without it

    path = Path(path)
    tokens = list(source["tokenizer.ggml.tokens"])
    types = [int(t) for t in _plain(source["tokenizer.ggml.token_type"])]
    merges = list(source["tokenizer.ggml.merges"])
    two = [f"{i:02d}" for i in range(100)]
    three = [f"{i:03d}" for i in range(1000)]
    tokens += two + three
    types += [1] * (len(two) + len(three))  # NORMAL
    merges += [f"{d[0]} {d[1]}" for d in two]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(f"synthetic {pre} vocabulary")
    # Dummy hyperparameters: llama.cpp's vocab-only load skips them today, but older
    # versions read them before the vocabulary.
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(32)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(source["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(source["tokenizer.ggml.eos_token_id"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_byte_vocab_gguf(path, *, model: str = "gpt2", pre: str | None = "gpt-2", chat_template: str | None = None):
    """A tokenizer-only GGUF at `path`: a 258-token byte-level vocabulary (the 256 byte
    symbols, one merge, one control token), optionally with a chat template."""
    import gguf

    from minivllm.gguf.tokenizer import _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + ["Ġb", "<|endoftext|>"]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3])
    w.add_token_merges(["Ġ b"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(257)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
