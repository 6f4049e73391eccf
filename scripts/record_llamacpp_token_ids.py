"""Record llama.cpp's token ids for the tokenizer corpus: the reference
tests/integration/gguf/test_tokenizer.py checks against.

llama.cpp is the judge of what a GGUF vocabulary's tokenizer does, so its ids are
recorded once and committed; the test suite never imports llama_cpp.

How the committed files in data/tokenizer_reference/ were recorded:

    # scratch environment, separate from the project venv
    python3 -m venv /tmp/lcpp
    /tmp/lcpp/bin/pip install llama-cpp-python==0.3.36 gguf==0.19.0   # builds llama.cpp from source (CPU)
    # (llama-cpp-python 0.3.36 vendors llama.cpp at commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f)

    /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py \\
        SmolLM2-135M-Instruct.Q4_1.gguf data/tokenizer_reference/smollm2-135m.llamacpp.json
    /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py \\
        Qwen2.5-Coder-0.5B-Instruct.gguf data/tokenizer_reference/qwen2.5-coder-0.5b.llamacpp.json
    for pre in llama-bpe gpt-2 default; do
        /tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py --synthetic-pre $pre \\
            SmolLM2-135M-Instruct.Q4_1.gguf data/tokenizer_reference/$pre-synthetic.llamacpp.json
    done

(the two model files are the ones `minivllm` resolves as `smollm2-135m` and
`qwen2.5-coder-0.5b`). With `--synthetic-pre PRE`, MODEL.gguf is only the source of
the vocabulary: the script writes a vocab-only GGUF with that vocabulary (plus
2- and 3-digit tokens that tell the digit rules apart) and `tokenizer.ggml.pre = PRE`
using `tests/tokenizer_fixtures.write_synthetic_vocab_gguf`, the same function the
tests use (bytes are identical for the same gguf version), and records that file.

Every corpus text (data/tokenizer_corpus.json) is tokenized with add_bos=True and
special=True (llama.cpp's add_special / parse_special: BOS is added only if the model
asks for it); the corpus lists a few texts to repeat with special=False or
add_bos=False. The output also holds llama.cpp's BOS/EOS ids, its add_bos setting,
its end-of-generation and control token sets, llama.cpp's own detokenization of each
case, the file's SHA-256 and a SHA-256 of its `tokenizer.*` metadata.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tokenizer_fixtures import load_corpus, tokenizer_metadata_sha256, write_synthetic_vocab_gguf  # noqa: E402

# llama-cpp-python does not expose the llama.cpp commit it vendors; this is the
# vendor/llama.cpp submodule HEAD of the llama-cpp-python 0.3.36 source distribution.
LLAMA_CPP_COMMITS = {"0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_metadata(path: Path) -> dict:
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def vocab_facts(llm: llama_cpp.Llama) -> dict:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    return {
        "n_tokens": n,
        "bos_id": llama_cpp.llama_vocab_bos(vocab),
        "eos_id": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog_ids": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "control_ids": [i for i in range(n) if llama_cpp.llama_vocab_is_control(vocab, i)],
    }


def detokenize(vocab, ids: list[int]) -> str:
    """llama.cpp's own detokenizer (special tokens rendered, its space clean-up applied).

    `Llama.detokenize` is not used: it goes through a 32-byte piece buffer per token.
    """
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = (ctypes.c_char * size)()
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        if n >= 0:
            return bytes(buf[:n]).decode("utf-8", errors="replace")
        size = -n


def record(model_path: Path) -> tuple[dict, list[dict]]:
    llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    corpus = load_corpus()
    runs = [(t, True, True) for t in corpus["texts"]]
    runs += [(t, True, False) for t in corpus["also_without_special_parsing"]]
    runs += [(t, False, True) for t in corpus["also_without_bos"]]
    cases = []
    for text, add_bos, special in runs:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
        detok = detokenize(llama_cpp.llama_model_get_vocab(llm.model), ids)
        cases.append({"text": text, "add_bos": add_bos, "special": special, "ids": ids, "detokenized": detok})
    return vocab_facts(llm), cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="GGUF file (with --synthetic-pre: the vocabulary source)")
    ap.add_argument("out", type=Path, help="output JSON")
    ap.add_argument("--synthetic-pre", help="record a synthetic vocab-only file with this tokenizer.ggml.pre")
    args = ap.parse_args(argv)

    source_meta = read_metadata(args.model)
    header = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_commit": LLAMA_CPP_COMMITS.get(llama_cpp.__version__, "unknown"),
        "command": "/tmp/lcpp/bin/python scripts/record_llamacpp_token_ids.py "
        + (f"--synthetic-pre {args.synthetic_pre} " if args.synthetic_pre else "")
        + f"{args.model.name} {args.out.as_posix()}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic_pre:
            target = write_synthetic_vocab_gguf(Path(tmp) / "synthetic.gguf", args.synthetic_pre, source_meta)
            meta = read_metadata(target)
            header |= {
                "model": f"synthetic {args.synthetic_pre} (vocabulary of {source_meta.get('general.name')})",
                "source_gguf": args.model.name,
                "source_gguf_sha256": file_sha256(args.model),
            }
        else:
            target, meta = args.model, source_meta
            header |= {"model": meta.get("general.name"), "source_gguf": args.model.name}
        header |= {
            "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
            "gguf_sha256": file_sha256(target),
            "tokenizer_metadata_sha256": tokenizer_metadata_sha256(meta),
        }
        vocab, cases = record(target)

    # One case per line keeps the file reviewable and its diffs small.
    head = json.dumps(header, ensure_ascii=False, indent=1)[:-2]
    facts = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in vocab.items())
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f'{head},\n "vocab": {{\n{facts}\n }},\n "cases": [\n{body}\n ]\n}}\n', encoding="utf-8"
    )
    print(f"{args.out}: {len(cases)} cases, llama.cpp {header['llama_cpp_commit'][:7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
