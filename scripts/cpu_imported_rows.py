"""Decode step time of one CPU engine holding 1 or 2 long requests, imported (as a split
request's decode half arrives: pages from another engine's export) or prefilled here.

Why: in `bench disaggregation --burst` on the H100 machine, two split requests decoding
together on the CPU worker ran at ~6-8 tokens/s each where one alone ran at ~30 (issue 43).
This measures the engine alone, outside the cluster, so the two can be told apart:

    python scripts/cpu_imported_rows.py MODEL.gguf --context 4096 --threads 8

Prints one line per case: ms per decode step (median over the steps after every row has
its first token). Two cases repeat the imported ones in a shareable pool (a memfd mapping,
`cache/shared_pool_memory.py`), as the cluster's CPU worker has it: shared memory may get
no transparent huge pages where anonymous memory does. The last two also run the worker's
warm-up and calibration first, as a cluster worker has before any split arrives, so the
imported requests get pages in the order those requests left them, not a fresh pool's.
With `--neighbours 4,8` the imported 1- and 2-row cases run again beside that many
processes that each keep one core busy, as the GPU worker's loop, the router and the
clients do in the cluster: a parallel region waits for its slowest thread, so a CPU
worker sharing cores (or hyperthread siblings) with busy neighbours can slow far more
than its share of the cores. `--pin` then runs the process on `threads` cores of its own,
one per physical core first (hyperthread siblings last), and the neighbours on the others:
the layout a cluster could give its CPU worker; `--skip-base` runs the neighbour cases only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch


def step_ms(engine, rids) -> list[float]:
    while not all(engine.request_state(r).output_ids for r in rids):
        engine.step()
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    return times


@contextlib.contextmanager
def busy_neighbours(n: int, cores: set[int] | None = None):
    """n processes spinning in pure Python, one core each, until the block ends (on
    `cores` only, if given)."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # let them get scheduled
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per request")
    ap.add_argument("--stagger", type=int, default=3, help="decode steps between the two imports in the staggered case")
    ap.add_argument("--neighbours", default="", help="comma-separated counts of busy processes beside the 1- and 2-row "
                    "imported cases, e.g. 4,8")
    ap.add_argument("--pin", action="store_true", help="this process on `threads` cores, physical cores first; "
                    "the neighbours on the rest")
    ap.add_argument("--skip-base", action="store_true", help="only the neighbour cases")
    args = ap.parse_args()
    from minivllm.serving.cpu_placement import cpus_physical_first

    others = None
    if args.pin:  # before torch starts its threads: they inherit the mask they are created with
        order = cpus_physical_first()
        mine, others = set(order[:args.threads]), set(order[args.threads:]) or None
        os.sched_setaffinity(0, mine)
        print(f"pinned to CPUs {sorted(mine)}; neighbours on {sorted(others or mine)}", flush=True)
    from minivllm import LLM, SamplingParams
    from minivllm.engine.engine import LLMEngine
    from minivllm.engine.engine_config import EngineConfig

    torch.set_num_threads(args.threads)
    ctx = args.context
    llm = LLM(args.model, device="cpu", max_model_len=ctx + 2 * args.tokens, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def engine(shareable: bool = False) -> LLMEngine:
        return LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=ctx + 2 * args.tokens,
                                                                max_active_requests=4, kv_shareable=shareable))

    prompts = [[100 + i + j % 1000 for j in range(ctx)] for i in range(2)]
    a = engine()
    exported = [a.add_request(p, params) for p in prompts]
    while not all(a.request_state(r).output_ids for r in exported):
        a.step()
    handoffs = [a.export_request(r) for r in exported]
    cases = ((1, True, 0, False, False), (2, True, 0, False, False), (2, True, args.stagger, False, False),
             (2, False, 0, False, False), (1, True, 0, True, False), (2, True, 0, True, False),
             (1, True, 0, True, True), (2, True, 0, True, True))
    cases = [] if args.skip_base else [(*c, 0) for c in cases]
    cases += [(rows, True, 0, True, False, int(n)) for n in args.neighbours.split(",") if n for rows in (1, 2)]
    for rows, imported, stagger, shareable, history, neighbours in cases:
        b = engine(shareable)
        if history:  # as a cluster worker is when a split arrives: warmed up and calibrated first,
            # so its free pages are in whatever order those requests left them
            from minivllm.serving.calibration import calibrate, warm_up

            warm_up(b)
            calibrate(b)
        if stagger:  # as in the cluster: the second arrives while the first decodes, rows then a few tokens apart
            rids = [b.import_request(handoffs[0])]
            for _ in range(stagger):
                b.step()
            rids.append(b.import_request(handoffs[1]))
        else:
            rids = ([b.import_request(h) for h in handoffs[:rows]] if imported
                    else [b.add_request(p, params) for p in prompts[:rows]])
        with busy_neighbours(neighbours, others):
            ms = step_ms(b, rids)
        how = "imported" if imported else "prefilled here"
        how += f", the second {stagger} steps after the first" if stagger else ""
        how += ", shared pool" if shareable else ""
        how += ", after warm-up and calibration" if history else ""
        how += f", beside {neighbours} busy processes" if neighbours else ""
        how += ", pinned" if args.pin else ""
        print(f"context {ctx}, threads {args.threads}, {rows} row(s), {how}: "
              f"{statistics.median(ms):.1f} ms per decode step (median of {len(ms)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
