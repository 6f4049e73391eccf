"""`minivllm smoke`: one request per worker, all at once, and a per-backend throughput table.

    minivllm smoke --model qwen2.5-coder-0.5b --inference-device cpu --inference-device gpu --inference-device gpu

starts a Cluster with those workers, pins one request to each (greedy, EOS ignored, so
every output has exactly --max-tokens tokens), waits for all of them and prints
Backend | Input tokens | Output tokens | Prefill tok/s | Decode tok/s, one row per worker
(rates from each request's engine metrics). Workers skip calibration: nothing is routed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minivllm.bench import common
from minivllm.bench.driver import Driver
from minivllm.devices import DTYPE_CHOICES

DEFAULT_PROMPT_FILE = Path(__file__).resolve().parents[3] / "data" / "speculative" / "code_refactor.txt"


def default_prompt() -> str:
    """A few hundred tokens of text (a code-refactoring request)."""
    return DEFAULT_PROMPT_FILE.read_text()


@dataclass
class Settings:
    model: str
    inference_device: list[str] | None
    max_tokens: int
    prompt: str | None
    activation_dtype: str
    option: list[str]
    json: str | None


def add_arguments(p) -> None:
    common.add_model(p, help="registered name or .gguf path (default smollm2-135m)")
    common.add_inference_device(p, default=None, repeatable=True,
                                help="repeatable: cpu, cpu:THREADS, gpu, cuda:N (default: cpu)")
    common.add_max_tokens(p, 128, "output tokens per request (EOS ignored)")
    p.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT_FILE.name} from data/)")
    common.add_activation_dtype(p, choices=DTYPE_CHOICES)
    common.add_option(p, "engine option for every worker (repeatable), e.g. enforce_eager=true")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and provenance to PATH")


def run(s: Settings) -> int:
    from minivllm.bench.common import provenance
    from minivllm.bench.routing import backend_label
    from minivllm.models.cache import sha256_file
    from minivllm.sampling.sampling_params import SamplingParams
    from minivllm.serving import Cluster

    devices = s.inference_device or ["cpu"]
    prompt = s.prompt if s.prompt is not None else default_prompt()
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
    options = common.engine_options(s.option)
    with Cluster(s.model, devices, router="round-robin", dtype=s.activation_dtype, calibrate=False, progress=True,
                 **options) as cluster:
        workers = {w["name"]: w for w in cluster.snapshot()["workers"]}
        streams = [cluster.submit(prompt, params, worker=name) for name in workers]
        outputs = [s.result() for s in streams]
        model_path = cluster.model_path
    rows = []
    for stream, out in zip(streams, outputs):
        if out.finish_reason == "error":
            raise RuntimeError(f"worker {stream.worker}: {stream.error}")
        m = out.metrics
        rows.append({"worker": stream.worker, "backend": backend_label(workers[stream.worker]["info"]),
                     "input_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                     "prefill_tok_s": m.prefill_tokens_per_s, "decode_tok_s": m.decode_tokens_per_s,
                     "ttft_s": m.time_to_first_token_s, "e2e_s": m.e2e_s, "finish_reason": out.finish_reason})
    print(render(rows))
    if s.json:
        settings = {"model": s.model, "inference_devices": devices, "activation_dtype": s.activation_dtype,
                    "max_tokens": s.max_tokens, "prompt": "default" if s.prompt is None else "given",
                    "engine_options": options, "sampling": "greedy, ignore_eos", "router": "pinned, one per worker"}
        meta = provenance("cpu", sha256_file(Path(model_path)), settings)
        meta["device"] = " + ".join(f"{r['worker']}: {r['backend']}" for r in rows)
        Path(s.json).parent.mkdir(parents=True, exist_ok=True)
        Path(s.json).write_text(json.dumps({"command": "smoke", "provenance": meta, "rows": rows}, indent=2))
        print(f"wrote {s.json}")
    return 0


def render(rows: list[dict]) -> str:
    lines = ["| Backend | Input tokens | Output tokens | Prefill tok/s | Decode tok/s |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['input_tokens']:,} | {r['output_tokens']:,} | {r['prefill_tok_s']:,.2f} | "
                     f"{r['decode_tok_s']:,.2f} |")
    return "\n".join(lines)


# A top-level command (`minivllm smoke`), registered with the benchmark drivers so `bench all` runs it.
DRIVER = Driver("smoke", "send one request to every worker at once; print per-backend throughput", add_arguments,
                Settings, run, command=("smoke",))
