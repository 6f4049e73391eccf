"""Single-request prefill and decode speed per device and activation dtype.

One request at a time through the engine (so no batching effects), greedy,
`ignore_eos` so every run decodes exactly `max_tokens` tokens. Reported per run:
prefill tokens/s (prompt tokens / time to first token) and decode tokens/s.
"""

from __future__ import annotations

from minivllm.bench.results import provenance, summarize, write_results
from minivllm.devices import resolve_device
from minivllm.engine.llm import LLM
from minivllm.engine.sampling_params import SamplingParams
from minivllm.models.cache import sha256_file

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type, oil-based ink and a wine press into a machine that")


def run(model: str, devices: list[str], dtypes: list[str], max_tokens: int = 64, repeats: int = 3) -> list[dict]:
    rows = []
    sha = None
    for dev in devices:
        for dt in dtypes:
            llm = LLM(model, device=dev, dtype=dt, progress=False)
            sha = sha or sha256_file(llm.model_path)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
            prefill, decode = [], []
            for _ in range(repeats):
                m = llm.generate(PROMPT, params)[0].metrics
                prefill.append(m.prompt_tokens / m.time_to_first_token_s)
                decode.append(m.decode_tokens_per_s)
            p, d = summarize(prefill), summarize(decode)
            rows.append({"device": str(resolve_device(dev)), "dtype": dt, "prompt_tokens": m.prompt_tokens,
                         "decode_tokens": max_tokens, "prefill_tok_s_median": p["median"], "prefill_tok_s_std": p["std"],
                         "decode_tok_s_median": d["median"], "decode_tok_s_mean": d["mean"], "decode_tok_s_std": d["std"]})
            del llm
    for r in rows:  # ratios measured in the same run, against the first row
        r["decode_vs_first_row"] = r["decode_tok_s_median"] / rows[0]["decode_tok_s_median"]
    meta = provenance(devices[0], sha, {"model": model, "devices": devices, "dtypes": dtypes,
                                        "max_tokens": max_tokens, "repeats": repeats, "prompt": PROMPT})
    cols = ["device", "dtype", "prompt_tokens", "decode_tokens", "prefill_tok_s_median", "prefill_tok_s_std",
            "decode_tok_s_median", "decode_tok_s_mean", "decode_tok_s_std", "decode_vs_first_row"]
    _, md = write_results(f"decode-{model}", meta, rows, cols,
                          "Serial (one request) generation speed, reference dense kernels, greedy.")
    print(md.read_text())
    return rows
