"""`minivllm bench disaggregation`: issue 43's experiment. When does serving a request as
prefill on worker A and decode on worker B (the K/V moved between them) finish sooner than
serving it whole on A or whole on B, and how close does the articles' formula come?

The articles' formula (seed article 2): moving the K/V costs `transfer_ms`; over an answer
of n tokens that is `transfer_ms / n` per token, so decoding on B pays only if B's time
per output token beats A's by more than that (`break_even_ms_per_token`).

Workers: A then B (`--inference-device`, default "gpu" then "cpu" where CUDA is present,
else two one-thread CPU workers). Cases: every prompt length x answer length x backlog.
A backlog of N is N long greedy requests decoding on A (pinned there, started afresh for
every measured request, all decoding before it arrives, cancelled when it ends, so their
K/V never outgrows the pool): the "GPU busy with other users" of the issue. Modes, each
one request at a time on the same cluster:

    whole:A  whole:B   the request pinned to one worker (Cluster.submit(worker=...))
    split              prefill and first token on A, decode on B (placement=(A, B))
    router             no placement, router "cost+split": whatever it picks; its decision
                       record (every whole and split candidate's terms) is kept

Prompts are unique per run (a tag first), so no prefix cache helps any mode, unless a
case puts `cached_on_a` of the prompt's first tokens in A's prefix cache beforehand (a
prefix of its own per run, served on A alone, untimed): the system prompt only A has
seen, where a split can prefill cheaply on A and still decode on B. Greedy, EOS
ignored, exactly n output tokens. Per run the client times submit -> first token -> end;
a split run also records the bytes and milliseconds of the handoff (split_request.py).
Modes are interleaved run by run (A B S R A B S R ...) so drift hits them alike.

Per case it reports the median and mean ± std of each mode's end-to-end time, the fastest
mode, the split's measured verdict against whole:A (the formula's comparison) and the
formula's verdict from the same runs: A's ms per output token (whole:A) minus B's (the
split's decode half) against transfer_ms / n. `router_agrees` says whether the router's
pick was the measured fastest (or within 5% of it). The link row compares the handoff's
copy rate (bytes over A's write into B's reserved pages, plus B's read where the K/V went
through a segment instead) with one plain `copy_` of the same bytes from A's device to
host memory (pinned where A is a GPU).
"""

from __future__ import annotations

import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.bench.common import loadavg, model_label, provenance, record_stat
from minivllm.bench.disaggregation_burst import measure_burst, render_burst
from minivllm.bench.results import write_results
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams

TEXT_FILE = Path(__file__).resolve().parents[2] / "data" / "speculative" / "code_refactor.txt"
MODES = ("whole:A", "whole:B", "split", "router")
DEFAULTS = {"prompts": [512, 1024, 2048, 4096, 8192], "outputs": [128, 512], "backlogs": [0, 8], "runs": 3}
QUICK = {"prompts": [64, 160], "outputs": [8], "backlogs": [0, 2], "runs": 1}
BACKLOG_PROMPT_TOKENS = 32
NEAR_FASTEST = 1.05  # the router "agrees" when its pick is within 5% of the measured fastest
RESULT_TIMEOUT_S = 3600.0


def default_devices() -> list[str]:
    import torch

    return ["gpu", "cpu"] if torch.cuda.is_available() else ["cpu:1", "cpu:1"]


def model_context(model_path) -> int:
    from minivllm.gguf.reader import open_gguf
    from minivllm.model.config import ModelConfig

    return ModelConfig.from_gguf(open_gguf(model_path)).context_length


class Prompts:
    """Token-id prompts of an exact length, each opening with its own tag (no shared prefix)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        text = TEXT_FILE.read_text()
        self.filler = tokenizer.encode(text, add_bos=False)
        self.text = text

    def make(self, uid: str, length: int) -> list[int]:
        head = self.tok.encode(f"Request {uid}:\n")
        while len(head) + len(self.filler) < length:
            self.filler += self.tok.encode("\n\n" + self.text, add_bos=False)
        return (head + self.filler)[:length]


@dataclass
class Timed:
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0


def timed_request(cluster, prompt: list[int], params: SamplingParams, **where) -> tuple[Timed, object]:
    t = Timed(submitted=time.perf_counter())
    stream = cluster.submit(prompt, params, **where)
    for event in stream:
        now = time.perf_counter()
        if event.token_id >= 0:
            t.tokens += 1
            if t.first_token is None:
                t.first_token = now
        if event.finished:
            t.finished = now
    out = stream.result(RESULT_TIMEOUT_S)
    if out.finish_reason != "length" or len(out.token_ids) != params.max_tokens:
        raise RuntimeError(f"disaggregation: a request on {stream.worker} ended {out.finish_reason!r} after "
                           f"{len(out.token_ids)} of {params.max_tokens} tokens: {stream.error}")
    return t, stream


@dataclass
class Backlog:
    """N long greedy requests decoding on one worker while a case is measured."""

    streams: list = field(default_factory=list)
    threads: list = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, cluster, worker: str, n: int, prompts: Prompts, max_tokens: int, tag: str) -> "Backlog":
        backlog = cls()
        firsts = threading.Semaphore(0)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n):
            stream = cluster.submit(prompts.make(f"backlog {tag}.{i}", BACKLOG_PROMPT_TOKENS), params, worker=worker)

            def drain(stream=stream):
                seen = False
                for event in stream:
                    if not seen and event.token_id >= 0:
                        seen = True
                        firsts.release()
                if not seen:
                    firsts.release()

            t = threading.Thread(target=drain, name=f"backlog-{i}", daemon=True)
            t.start()
            backlog.streams.append(stream)
            backlog.threads.append(t)
        for _ in range(n):  # every backlog request is decoding before the measured one arrives
            firsts.acquire(timeout=RESULT_TIMEOUT_S)
        return backlog

    def held(self) -> bool:
        """No backlog request ended on its own while the case ran."""
        return not any(s.finished for s in self.streams)

    def stop(self) -> None:
        for s in self.streams:
            s.cancel()
        for t in self.threads:
            t.join(60)


def one_run(cluster, mode: str, a: str, b: str, prompt: list[int], params: SamplingParams) -> dict:
    where = {"whole:A": {"worker": a}, "whole:B": {"worker": b}, "split": {"placement": (a, b)}, "router": {}}[mode]
    t, stream = timed_request(cluster, prompt, params, **where)
    n = params.max_tokens
    rec = {"mode": mode, "e2e_s": t.finished - t.submitted, "ttft_s": t.first_token - t.submitted,
           "decode_ms_per_token": (t.finished - t.first_token) * 1e3 / (n - 1) if n > 1 else None,
           "worker": stream.worker, "cached_prompt_tokens": (stream.metrics or {}).get("cached_prompt_tokens")}
    split = (stream.metrics or {}).get("split")
    decision = stream.decision or {}
    if split and split.get("handed_off"):
        # The decode half's ms per token: the time after the handoff, over B's tokens.
        after_ms = (t.finished - t.first_token) * 1e3 - split["handoff_ms"]
        rec.update(kv_bytes=split["kv_bytes"], kv_tokens=split["kv_tokens"], handoff_ms=split["handoff_ms"],
                   write_ms=split["write_ms"], read_ms=split["read_ms"], copy_mb_per_s=split["copy_mb_per_s"],
                   link_bytes=split.get("link_bytes", split["kv_bytes"]), link_ms=split.get("link_ms"),
                   link_mb_per_s=split.get("link_mb_per_s"),
                   decode_half_ms_per_token=after_ms / max(1, n - split["tokens_on_prefill_worker"]),
                   transport=split.get("transport"), attach_ms=split.get("attach_ms"),
                   prefill_worker=split["prefill_worker"], decode_worker=split["decode_worker"])
    if mode == "router":
        placed = decision.get("split")
        rec["router_pick"] = "split" if placed else ("whole:A" if decision.get("chosen") == a else "whole:B")
        rec["decision"] = {k: decision.get(k) for k in ("reason", "chosen", "split", "candidates", "split_candidates")}
    return rec


def plain_copy_mb_per_s(nbytes: int, device: str, repeats: int = 5) -> float:
    """One `copy_` of `nbytes` from `device` into a host buffer allocated once, the median of
    `repeats`: from a GPU into pinned memory (the DMA a transfer could have), from a CPU into
    ordinary memory. The handoff, too, writes into memory that exists already: the decode
    worker's own pages (kv_landing.py)."""
    import torch

    dev = torch.device(device)
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    dst = torch.zeros(src.shape, dtype=src.dtype, pin_memory=dev.type == "cuda")
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return src.nbytes / 1e6 / statistics.median(times)


def summarize_case(case: dict, runs: list[dict]) -> dict:
    row = dict(case)
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    for m, rs in by_mode.items():
        record_stat(row, f"{m}_e2e_s", [r["e2e_s"] for r in rs], column=m)
        record_stat(row, f"{m}_ttft_s", [r["ttft_s"] for r in rs], column=False)
    medians = {m: row[f"{m}_e2e_s_median"] for m in ("whole:A", "whole:B", "split")}
    row["fastest"] = min(medians, key=medians.get)
    row["split_vs_whole_A"] = medians["split"] / medians["whole:A"]
    row["split_vs_best_whole"] = medians["split"] / min(medians["whole:A"], medians["whole:B"])
    # Only split runs whose K/V moved measure the split (one that ended on A first, e.g. a
    # reservation later than the whole answer, is a whole:A run in disguise).
    splits = [r for r in by_mode["split"] if "handoff_ms" in r]
    row["split_runs_handed_off"] = f"{len(splits)}/{len(by_mode['split'])}"
    if not splits:
        raise RuntimeError(f"disaggregation: no split run of {case} handed its K/V off (each ended on A first); "
                           "use longer answers")
    n = case["max_tokens"]
    transfer_ms = statistics.median(r["handoff_ms"] for r in splits)
    a_tpot = statistics.median(r["decode_ms_per_token"] for r in by_mode["whole:A"])
    b_tpot = statistics.median(r["decode_half_ms_per_token"] for r in splits)
    row.update(kv_bytes=splits[0]["kv_bytes"], transfer_ms=transfer_ms,
               transport="/".join(sorted({str(r.get("transport")) for r in splits})),
               copy_mb_per_s=statistics.median(r["copy_mb_per_s"] for r in splits if r["copy_mb_per_s"]),
               write_ms=statistics.median(r["write_ms"] for r in splits),
               link_bytes=splits[0]["link_bytes"],
               link_mb_per_s=statistics.median(r["link_mb_per_s"] for r in splits if r.get("link_mb_per_s")),
               attach_ms=[r.get("attach_ms") for r in splits],  # each split's wait for the mapping (landing)
               a_ms_per_token=a_tpot, b_ms_per_token=b_tpot, advantage_ms_per_token=a_tpot - b_tpot,
               break_even_ms_per_token=transfer_ms / n)
    row["formula_says_split_pays"] = row["advantage_ms_per_token"] > row["break_even_ms_per_token"]
    row["measured_split_pays"] = medians["split"] < medians["whole:A"]
    row["formula_right"] = row["formula_says_split_pays"] == row["measured_split_pays"]
    # The formula's split time from the whole runs: A's first token, the handoff, B's per-token time.
    predicted = row["whole:A_ttft_s_median"] + transfer_ms / 1e3 + (n - 1) * statistics.median(
        r["decode_ms_per_token"] for r in by_mode["whole:B"]) / 1e3
    row["formula_split_e2e_s"] = predicted
    row["formula_error"] = predicted / medians["split"] - 1
    picks = [r["router_pick"] for r in by_mode["router"]]
    row["router_pick"] = max(set(picks), key=picks.count)
    row["router_agrees"] = medians[row["router_pick"]] <= NEAR_FASTEST * medians[row["fastest"]]
    row["router_decision"] = by_mode["router"][0]["decision"]
    return row


def seed_prefix(cluster, worker: str, prefix: list[int]) -> None:
    """Serve `prefix` plus one token on `worker` alone, so its prefix cache holds the
    prefix's pages (as a system prompt that worker served before)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = cluster.submit(prefix + prefix[-1:], params, worker=worker).result(RESULT_TIMEOUT_S)
    if out.finish_reason != "length":
        raise RuntimeError(f"disaggregation: seeding the prefix on {worker} ended {out.finish_reason!r}: {out.error}")


def measure_case(cluster, a: str, b: str, texts: Prompts, *, prompt_tokens: int, max_tokens: int, backlog: int,
                 runs: int, backlog_tokens: int, cached_on_a: int = 0) -> dict:
    """One case on a running cluster (workers `a` and `b`, router cost+split): every mode
    `runs` times, interleaved, a fresh backlog of `backlog` requests (of `backlog_tokens`
    answer tokens, cancelled when the measured one ends) on `a` for each. `cached_on_a`:
    the prompt's first tokens (whole pages), a prefix of its own for every run, served on
    `a` just before (untimed), so only `a`'s prefix cache holds it. Returns the case's row
    (`summarize_case`) with the runs' records under "runs"."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    records = []
    for r in range(runs):
        for mode in MODES:
            uid = f"{prompt_tokens}.{max_tokens}.{backlog}.{cached_on_a}.{r}.{mode}.{time.monotonic_ns()}"
            prompt = texts.make(uid, prompt_tokens)
            if cached_on_a:
                seed_prefix(cluster, a, prompt[:cached_on_a])
            load = Backlog.start(cluster, a, backlog, texts, backlog_tokens, uid) if backlog else None
            try:
                rec = one_run(cluster, mode, a, b, prompt, params)
                rec["backlog_held"] = load.held() if load else True
            finally:
                if load:
                    load.stop()
            rec["run"] = r + 1
            records.append(rec)
    row = summarize_case({"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "backlog": backlog,
                          "cached_on_a": cached_on_a}, records)
    row["backlog_held"] = all(rec["backlog_held"] for rec in records)
    row["runs"] = records
    return row


def run(model: str = "smollm2-135m", devices: list[str] | None = None, dtype: str = "auto", *,
        prompts: list[int] | None = None, outputs: list[int] | None = None, backlogs: list[int] | None = None,
        cached_on_a: list[int] | None = None, runs: int | None = None, quick: bool = False,
        engine_options: dict | None = None, burst: int = 0, pin_cpus: bool = False) -> list[dict]:
    """Every (prompt, output, backlog) case, every mode `runs` times; writes
    benchmarks/results/disaggregation-<model>-<stamp>.{json,md}; returns the case rows."""
    from minivllm.models import resolve_model
    from minivllm.models.cache import sha256_file
    from minivllm.serving import Cluster

    base = QUICK if quick else DEFAULTS
    prompts, outputs = list(prompts or base["prompts"]), list(outputs or base["outputs"])
    backlogs = list(base["backlogs"] if backlogs is None else backlogs)
    runs = base["runs"] if runs is None else runs
    cached_on_a = list(cached_on_a or [0])
    devices = list(devices or default_devices())
    if len(devices) != 2:
        raise ConfigError("inference_device", devices, "give exactly two: the prefill worker A, then the decode "
                                                       "worker B (e.g. --inference-device gpu --inference-device cpu)")
    if any(c < 0 or c >= min(prompts) for c in cached_on_a):
        raise ConfigError("cached_on_a", cached_on_a, f"each below the shortest prompt ({min(prompts)} tokens)")
    if runs < 1 or min(outputs) < 2 or min(prompts) < 1 or min(backlogs) < 0:
        raise ConfigError("runs/outputs/prompts/backlogs", (runs, outputs, prompts, backlogs),
                          "runs >= 1, answers of 2 tokens or more, prompts >= 1 token, backlogs >= 0")
    path = resolve_model(model)
    context = model_context(path)
    longest = max(prompts) + max(outputs) + BACKLOG_PROMPT_TOKENS
    max_model_len = min(context, longest)
    clamped = {p: min(p, max_model_len - max(outputs) - 1) for p in prompts}
    if any(c != p for p, c in clamped.items()):
        print(f"disaggregation: the model's context is {context} tokens; prompts clamped: "
              + ", ".join(f"{p} -> {c}" for p, c in clamped.items() if c != p), flush=True)
    options = {"max_active_requests": max(backlogs) + 2, "max_model_len": max_model_len, **(engine_options or {})}
    load_start = loadavg()
    t_all = time.perf_counter()
    rows: list[dict] = []
    with Cluster(str(path), devices, router="cost+split", dtype=dtype, pin_cpus=pin_cpus, **options) as cluster:
        a, b = list(cluster.workers)
        snap = cluster.snapshot()
        workers = [{"name": w["name"], "device": w["device"], "threads": w["threads"],
                    "device_info": w["info"].get("device"), "kv_pages": w["info"].get("kv_pages"),
                    "cpu_kernels": w["info"].get("cpu_kernels"), "cpu_threads": w["info"].get("cpu_threads")}
                   for w in snap["workers"]]
        link_at_start = snap["splits"]["link"]
        texts = Prompts(cluster.tokenizer)
        page = snap["workers"][0]["snapshot"]["kv"]["page_size"]
        cases = [(c, k, n, p) for c in cached_on_a for k in backlogs for n in outputs for p in prompts]
        for cached, backlog_n, n, prompt_len in cases:
            length = clamped[prompt_len]
            row = measure_case(cluster, a, b, texts, prompt_tokens=length, max_tokens=n, backlog=backlog_n,
                               runs=runs, backlog_tokens=max_model_len - BACKLOG_PROMPT_TOKENS - 1,
                               cached_on_a=cached // page * page)
            rows.append(row)
            print(f"disaggregation prompt={length} n={n} backlog={backlog_n} cached on A={row['cached_on_a']}: "
                  + ", ".join(f"{m} {row[f'{m}_e2e_s_median']:.3f} s" for m in MODES)
                  + f"; fastest {row['fastest']}, router {row['router_pick']}, transfer "
                  f"{row['transfer_ms']:.1f} ms for {row['kv_bytes'] / 1e6:.1f} MB ({row['transport']}; write "
                  f"{row['write_ms']:.1f} ms, mapping waits {row['attach_ms']} ms)", flush=True)
        burst_row = None
        if burst:  # the first prompt and answer lengths, A holding the largest backlog
            burst_row = measure_burst(cluster, a, b, texts, Backlog, timed_request, burst=burst,
                                      prompt_tokens=clamped[prompts[0]], max_tokens=outputs[0],
                                      backlog=max(backlogs), backlog_tokens=max_model_len - BACKLOG_PROMPT_TOKENS - 1)
            print("disaggregation burst: " + "; ".join(
                f"{p} mean {r['e2e_s_mean']:.3f} s, makespan {r['makespan_s']:.3f} s, picks {r['picks']}"
                for p, r in burst_row["policies"].items()), flush=True)
        link_end = cluster.snapshot()["splits"]["link"]
        sha = sha256_file(Path(cluster.model_path))
        a_device = next(w["device"] for w in workers if w["name"] == a)  # the spec ("cuda:0"), not its description
    for row in rows:  # whole:A then waits for a backlog answer to end: the case the handoff rows are for
        row["a_at_slot_cap"] = row["backlog"] >= options["max_active_requests"]
    # The link's rate from the largest handoff with A otherwise idle, where there is one: under
    # a backlog A's gather and conversion share the GPU with its decode steps (reported beside).
    biggest = max(rows, key=lambda r: (r["backlog"] == 0, r["kv_bytes"]))
    loaded = max((r for r in rows if r["backlog"] > 0), key=lambda r: r["kv_bytes"], default=None)
    plain = plain_copy_mb_per_s(biggest["link_bytes"], a_device)
    link = {"bytes": biggest["kv_bytes"], "from_device": a_device, "handoff_copy_mb_per_s": biggest["copy_mb_per_s"],
            "link_bytes": biggest["link_bytes"], "link_mb_per_s": biggest["link_mb_per_s"],
            "plain_copy_mb_per_s": plain, "plain_over_link": plain / biggest["link_mb_per_s"],
            "handoff_ms": biggest["transfer_ms"], "backlog": biggest["backlog"],
            "under_backlog": None if loaded is None else {
                "backlog": loaded["backlog"], "link_bytes": loaded["link_bytes"],
                "link_mb_per_s": loaded["link_mb_per_s"], "handoff_ms": loaded["transfer_ms"]},
            "transport": biggest["transport"],
            "at_start": link_at_start, "at_end": link_end}
    settings = {"model": model, "inference_devices": devices, "activation_dtype": dtype, "prompts": prompts,
                "cached_on_a": cached_on_a,
                "prompts_clamped": clamped, "outputs": outputs, "backlogs": backlogs, "runs": runs, "quick": quick,
                "burst": burst, "pin_cpus": pin_cpus,
                "engine_options": options, "backlog_prompt_tokens": BACKLOG_PROMPT_TOKENS, "modes": list(MODES),
                "sampling": "greedy, ignore_eos", "wall_s": round(time.perf_counter() - t_all, 1),
                "method": "one cluster; one request at a time; modes interleaved run by run; unique prompts"}
    meta = provenance("cuda" if str(a_device).startswith("cuda") else "cpu", sha, settings)
    meta["device"] = " + ".join(f"{w['name']}: {w['device_info'] or w['device']}" for w in workers)
    meta["cpu"] = platform.processor() or platform.machine()
    meta["workers"] = {"A": a, "B": b, "list": workers}
    meta["link"] = link
    meta["burst"] = burst_row
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    notes = render(rows, a, b, link) + ("" if burst_row is None else "\n" + "\n".join(render_burst(burst_row, a, b)))
    columns = ["prompt_tokens", "cached_on_a", "max_tokens", "backlog", *MODES, "fastest", "router_pick",
               "router_agrees", "transfer_ms", "break_even_ms_per_token", "advantage_ms_per_token", "formula_right"]
    json_path, md_path = write_results(f"disaggregation-{model_label(model)}", meta, rows, columns, notes)
    print(notes, flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return rows


def render(rows: list[dict], a: str, b: str, link: dict) -> str:
    out = [f"A = {a} (prefill side), B = {b} (decode side). End-to-end seconds per mode, median (mean ± std "
           "over the runs). advantage = A's ms per output token (whole:A) minus B's (the split's decode half); "
           "break-even = transfer ms / output tokens (the articles' formula): the split pays by the formula "
           "where advantage > break-even.", "",
           f"Link: {link['bytes'] / 1e6:.1f} MB of K/V crossed it as {link['link_bytes'] / 1e6:.1f} MB in B's "
           f"dtype at {link['link_mb_per_s']:.0f} MB/s (A's gather, conversion and write into B's pages, plus "
           f"B's copy out where a segment carried it; transport: {link['transport']}); one plain copy_ of the "
           f"same {link['link_bytes'] / 1e6:.1f} MB from {link['from_device']} to host memory: "
           f"{link['plain_copy_mb_per_s']:.0f} MB/s ({link['plain_over_link']:.2f}x the link's rate). The whole "
           f"handoff, the messages between the processes and B's import included, took "
           f"{link['handoff_ms']:.1f} ms (the transfer column); backlog on A {link['backlog']}."
           + under_backlog(link), "",
           "| prompt | cached on A | answer | backlog on A | whole:A | whole:B | split | router (pick) | fastest "
           "| split ÷ whole:A | transfer ms (MB) | advantage ms/tok | break-even ms/tok | formula right "
           "| formula's split e2e (error) | router agrees |", "|" + "---|" * 16]
    for r in rows:
        cell = {m: f"{r[f'{m}_e2e_s_median']:.3f} ({r[f'{m}_e2e_s_mean']:.3f} ± {r[f'{m}_e2e_s_std']:.3f})"
                for m in MODES}
        held = (" (A at its slot cap)" if r.get("a_at_slot_cap") else
                "" if r["backlog_held"] else " (backlog ended early)")
        out.append(f"| {r['prompt_tokens']} | {r['cached_on_a']} | {r['max_tokens']} | {r['backlog']}{held} | "
                   f"{cell['whole:A']} | {cell['whole:B']} | {cell['split']} | {cell['router']} ({r['router_pick']}) | "
                   f"{r['fastest']} | "
                   f"{r['split_vs_whole_A']:.3f} | {r['transfer_ms']:.1f} ({r['kv_bytes'] / 1e6:.1f}) | "
                   f"{r['advantage_ms_per_token']:.3f} | {r['break_even_ms_per_token']:.3f} | "
                   f"{'yes' if r['formula_right'] else 'no'} | {r['formula_split_e2e_s']:.3f} "
                   f"({r['formula_error']:+.1%}) | {'yes' if r['router_agrees'] else 'no'} |")
    out += ["", *decision_tables(rows)]
    return "\n".join(out)


def under_backlog(link: dict) -> str:
    u = link.get("under_backlog")
    if u is None or link["backlog"] > 0:
        return ""
    return (f" With {u['backlog']} answers decoding on A, {u['link_bytes'] / 1e6:.1f} MB crossed at "
            f"{u['link_mb_per_s']:.0f} MB/s ({link['plain_copy_mb_per_s'] / u['link_mb_per_s']:.2f}x below the "
            f"plain copy), the handoff {u['handoff_ms']:.1f} ms.")


def decision_tables(rows: list[dict]) -> list[str]:
    """The router's score table (the articles' diagnostic) for each case's first router run."""
    out = []
    for r in rows:
        d = r["router_decision"]
        out += [f"### Router decision: prompt {r['prompt_tokens']} ({r['cached_on_a']} cached on A), answer "
                f"{r['max_tokens']}, backlog {r['backlog']} ({d['reason']})", "",
                "| candidate | active / queued | prefill s | transfer s | decode s | score s | break-even ms/tok |",
                "|---|---|---|---|---|---|---|"]
        for c in d["candidates"] or []:
            score = "—" if c.get("score") is None else f"{c['score']:.3f}"
            prefill = "—" if c.get("prefill_s") is None else f"{c['prefill_s']:.3f}"
            decode = "—" if c.get("decode_s") is None else f"{c['decode_s']:.3f}"
            out.append(f"| whole on {c['worker']} | {c['active']} / {c['queued']} | {prefill} | — | {decode} | "
                       f"{score} | — |")
        for s in d["split_candidates"] or []:
            out.append(f"| {s['prefill']} → {s['decode']} | | {s['prefill_s']:.3f} | {s['transfer_s']:.4f} | "
                       f"{s['decode_s']:.3f} | {s['score']:.3f} | {s['break_even_ms_per_token']:.4f} |")
        out.append("")
    return out
