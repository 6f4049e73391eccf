"""`run`: start the servers asked for, load each in turn with the same requests, write the results."""

from __future__ import annotations

import asyncio
import datetime as _dt
import math
import os
import re
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from minivllm.bench.common import provenance
from minivllm.bench.serve_load.client import drive, endpoint_path, probe
from minivllm.bench.serve_load.metrics import summarize
from minivllm.bench.serve_load.report import markdown, notes, request_row, table, write_files
from minivllm.bench.serve_load.workload import TOKENS_PER_WORD, LoadSettings, make_requests


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "server"


def default_label(url: str) -> str:
    return _safe(re.sub(r"^https?://", "", url))


def _load_tokenizer(name_or_path: str):
    from minivllm.gguf.tokenizer import Tokenizer
    from minivllm.models import resolve_model

    return Tokenizer.from_gguf(resolve_model(name_or_path, progress=False))


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


# -- the whole run --------------------------------------------------------------------------------


def run(urls: list[str] | None = None, labels: list[str] | None = None, settings: LoadSettings | None = None, *,
        models: list[str] | None = None, api_key: str | None = None, start_server: str | None = None,
        inference_devices: list[str] | None = None, serve_args: list[str] | None = None,
        tokenizer: str | None = None, warmup: int = 1, out_dir: str | Path | None = None, tag: str | None = None,
        ready_timeout_s: float = 900.0, progress: bool = True, write: bool = True,
        start_peer: str | None = None, peer_threads: int | None = None, peer_gpu_layers: int = 0,
        llama_cpp_path: str | None = None, backends: list[str] | None = None) -> dict:
    """Load each target in turn with the same seeded requests; returns {"targets": [...], "table": str,
    "files": [...]}. `start_server`: a model to serve with `python -m minivllm serve` (the first target).
    `start_peer="llama-cpp-python"`: then start llama-cpp-python's server on the same GGUF file
    (the second target; `peer_threads` CPU threads, default the machine's cores; `peer_gpu_layers`).
    `backends` (with `start_server`): one started server per entry, one after another, "local"
    or "ray" (`serve --backend ray` on a private Ray instance), labelled minivllm-<backend>."""
    from minivllm.bench import results as _results

    settings = settings or LoadSettings()
    urls = [u.rstrip("/") for u in (urls or [])]
    if start_peer is not None:
        from minivllm.bench.llama_cpp_server import LABEL, check_installed

        if start_peer != LABEL:
            raise ValueError(f"bench serve: --start-peer {start_peer!r}: the only peer it can start is {LABEL!r}")
        if not start_server:
            raise ValueError("bench serve: --start-peer serves the --start-server model; give --start-server too")
        check_installed(llama_cpp_path)
    backends = list(backends or ["local"])
    if any(b not in ("local", "ray") for b in backends):
        raise ValueError(f"bench serve: --backend {backends}: each is local or ray")
    n_starts = len(backends) if start_server else 0
    n_targets = len(urls) + n_starts + (1 if start_peer else 0)
    if n_targets == 0:
        raise ValueError("bench serve: give --url (repeatable) or --start-server")
    if labels and len(labels) != n_targets:
        raise ValueError(f"bench serve: {len(labels)} labels for {n_targets} servers (give one --label per server, "
                         "in order; the started server comes first)")
    url_models = list(models or [])
    if url_models and len(url_models) not in (1, len(urls)):
        raise ValueError(f"bench serve: {len(url_models)} --model values for {len(urls)} --url targets "
                         "(give one for all, or one per --url)")
    tok, tok_name = None, tokenizer or start_server
    if tok_name:
        try:
            tok = _load_tokenizer(tok_name)
        except Exception as exc:  # noqa: BLE001 - sizing by words still works
            print(
                f"bench serve: tokenizer {tok_name!r} not available ({exc}); prompt lengths are approximate", flush=True
            )
            tok_name = None
    specs = make_requests(settings, tok)
    out = Path(out_dir) if out_dir else _results.RESULTS_DIR
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    targets: list[dict] = []
    server = None
    try:
        plan = []
        if start_server:
            plan += [("start", None, None, b) for b in backends]
        if start_peer:
            plan.append(("peer", None, None, None))
        for i, u in enumerate(urls):
            plan.append(("url", u, url_models[0] if len(url_models) == 1 else (url_models[i] if url_models else None),
                         None))
        for k, (kind, url, model, backend) in enumerate(plan):
            model_sha = None
            serve_cmd = None
            if kind == "start":
                from minivllm.bench.server_process import ServerProcess
                from minivllm.models import resolve_model
                from minivllm.models.cache import sha256_file
                from minivllm.serving.http_server import free_port

                model_path = resolve_model(start_server, progress=progress)
                model_sha = sha256_file(Path(model_path))
                port = free_port()
                serve_cmd = ["--model", str(start_server), "--port", str(port)]
                for d in inference_devices or []:
                    serve_cmd += ["--inference-device", d]
                if api_key:
                    serve_cmd += ["--api-key", api_key]
                if backend == "ray":
                    serve_cmd += ["--backend", "ray", "--ray-address", "local"]
                serve_cmd += list(serve_args or [])
                if progress:
                    print("bench serve: starting python -m minivllm serve " + " ".join(serve_cmd), flush=True)
                log = Path(tempfile.mkdtemp(prefix="minivllm-bench-serve-")) / "serve.log"
                server = ServerProcess(serve_cmd, port, log).start(ready_timeout_s)
                url = server.url
            elif kind == "peer":
                from minivllm.bench.llama_cpp_server import LABEL, LlamaCppServer
                from minivllm.models import resolve_model
                from minivllm.models.cache import sha256_file
                from minivllm.serving.http_server import free_port

                model_path = resolve_model(start_server, progress=progress)
                model_sha = sha256_file(Path(model_path))
                threads = peer_threads or len(os.sched_getaffinity(0))
                # Room for the longest prompt and output of the run (plus a chat template's tokens).
                n_ctx = max(512, settings.max_input_len() + settings.max_output_len() + 64)
                log = Path(tempfile.mkdtemp(prefix="minivllm-bench-serve-")) / "llama-cpp-server.log"
                server = LlamaCppServer(model_path, free_port(), log, threads=threads, n_ctx=n_ctx,
                                        gpu_layers=peer_gpu_layers, llama_cpp_path=llama_cpp_path)
                serve_cmd = server.command()[1:]
                if progress:
                    print("bench serve: starting python " + " ".join(serve_cmd), flush=True)
                server.start(ready_timeout_s)
                url = server.url
            started = "minivllm" if len(backends) == 1 and backend == "local" else f"minivllm-{backend}"
            label = labels[k] if labels else ({"start": started, "peer": "llama-cpp-python"}.get(kind)
                                              or default_label(url))
            info = probe(url, api_key)
            served = [m.get("id") for m in (info["v1_models"].get("data") or []) if isinstance(m, dict)]
            send_model = model or (served[0] if served else None)
            if progress:
                print(f"bench serve {label}: {len(specs)} requests to {url}{endpoint_path(settings.endpoint)} "
                      f"(model {send_model!r})", flush=True)
            results, duration = asyncio.run(drive(url, specs, settings, model=send_model, api_key=api_key,
                                                  warmup=warmup, progress=progress, label=label))
            exit_code = None
            if kind in ("start", "peer") and server is not None:
                exit_code, server = server.stop(), None
            summary = summarize(results, duration, settings.slo_ttft_ms, settings.slo_tpot_ms, settings.ignore_eos)
            cfg = {
                "bench": "serve",
                **asdict(settings),
                "warmup": warmup,
                "tokenizer": tok_name,
                "prompt_sizing": "exact (tokenizer)" if tok is not None else f"approximate (words * {TOKENS_PER_WORD})",
            }
            prov = provenance("cpu", model_sha, _jsonable(cfg))
            prov["device_note"] = "`device` is the load generator's machine; the server is described under `target`"
            target = {
                "benchmark": "serve", "label": label, "provenance": prov,
                "target": {"url": url, "model": send_model, "started_here": serve_cmd, **info,
                           **({"server_exit_code": exit_code} if serve_cmd else {})},
                "notes": notes(settings, len(specs), url, send_model, tok is not None),
                "summary": summary,
                "requests": [request_row(r) for r in results],
            }
            targets.append(_jsonable(target))
            if write:
                name = f"serve-{_safe(label)}" + (f"-{_safe(tag)}" if tag else "") + f"-{stamp}"
                if any(Path(f).name == f"{name}.json" for t in targets[:-1] for f in t.get("files", [])):
                    name += f"-{k + 1}"  # the same label twice in one run
                files = write_files(out, name, targets[-1], markdown([targets[-1]]))
                targets[-1]["files"] = [str(f) for f in files]
    finally:
        if server is not None:
            server.stop()
    result = {"targets": targets, "table": table(targets), "files": [f for t in targets for f in t.get("files", [])]}
    if write and len(targets) > 1:
        name = (
            "serve-compare-"
            + "-vs-".join(_safe(t["label"]) for t in targets)
            + (f"-{_safe(tag)}" if tag else "")
            + f"-{stamp}"
        )
        combined = {"benchmark": "serve-compare", "labels": [t["label"] for t in targets],
                    "provenance": targets[0]["provenance"],
                    "targets": [{k: t[k] for k in ("label", "target", "notes", "summary", "files")} for t in targets]}
        result["files"] += [str(f) for f in write_files(out, name, combined, markdown(targets))]
    if progress:
        print()
        print(result["table"])
        for t in targets:
            for e in t["summary"]["errors"]:
                print(f"  {t['label']}: {e['count']} x {e['error']}")
        for f in result["files"]:
            print(f"  wrote {f}")
        sys.stdout.flush()
    return result


