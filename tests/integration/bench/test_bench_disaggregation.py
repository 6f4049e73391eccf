"""`minivllm bench disaggregation --quick` on two one-thread CPU workers.

References: the K/V bytes of a split by hand from SmolLM2-135M's shape (30 layers, 3 KV
heads of 64, f32, K and V) times the prompt's full 16-token pages; every derived column
(fastest mode, break-even, the formula's and the measured verdicts, the router's pick)
recomputed here from the per-run records the file keeps; /dev/shm for leftover segments.
No speed is asserted: that is what the result file is for.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
from conftest import PROVENANCE_KEYS

from minivllm.serving.kv_segment import SEGMENT_PREFIX

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 4 * 2
PAGE = 16


def median(runs, mode, key):
    return statistics.median(r[key] for r in runs if r["mode"] == mode)


def test_quick_disaggregation_bench(results_dir, smollm2_path):
    from minivllm.bench.disaggregation import MODES, QUICK, run

    shm_before = set(Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*"))
    rows = run(str(smollm2_path), ["cpu:1", "cpu:1"], quick=True)
    assert set(Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*")) <= shm_before  # no segment outlives the run
    (path,) = results_dir.glob("disaggregation-*.json")
    assert path.with_name(path.name[:-5] + ".md").exists()
    data = json.loads(path.read_text())
    meta = data["provenance"]
    assert PROVENANCE_KEYS <= set(meta) and meta["workers"]["A"] == "cpu" and meta["workers"]["B"] == "cpu#2"
    from minivllm.kernels import cpu_gemv  # whether the CPU workers ran the compiled kernels, as this process would

    want = cpu_gemv.isa() or f"not built: {cpu_gemv.unavailable_reason()}"
    assert [w["cpu_kernels"] for w in meta["workers"]["list"]] == [want, want]
    # each worker's torch runs the threads its device string asked for (cpu:1), on cores it may use
    assert [w["cpu_threads"]["torch"] for w in meta["workers"]["list"]] == [1, 1]
    assert all(1 <= w["cpu_threads"]["cores_allowed"] <= os.cpu_count() for w in meta["workers"]["list"])
    assert [(r["prompt_tokens"], r["backlog"]) for r in data["rows"]] == [
        (p, b) for b in QUICK["backlogs"] for p in QUICK["prompts"]]
    assert len(rows) == len(data["rows"])
    for row in data["rows"]:
        runs = row["runs"]
        assert sorted(r["mode"] for r in runs) == sorted(MODES * QUICK["runs"])
        n = row["max_tokens"]
        split = [r for r in runs if r["mode"] == "split"]
        moved = row["prompt_tokens"] // PAGE * PAGE
        assert all(r["kv_tokens"] == moved and r["kv_bytes"] == moved * KV_BYTES_PER_TOKEN for r in split)
        assert all((r["prefill_worker"], r["decode_worker"]) == ("cpu", "cpu#2") for r in split)
        assert [r["worker"] for r in runs if r["mode"] == "whole:A"] == ["cpu"] * QUICK["runs"]
        assert [r["worker"] for r in runs if r["mode"] == "whole:B"] == ["cpu#2"] * QUICK["runs"]
        medians = {m: median(runs, m, "e2e_s") for m in ("whole:A", "whole:B", "split")}
        assert row["fastest"] == min(medians, key=medians.get)
        transfer_ms = statistics.median(r["handoff_ms"] for r in split)
        assert row["break_even_ms_per_token"] == pytest.approx(transfer_ms / n)
        advantage = median(runs, "whole:A", "decode_ms_per_token") - statistics.median(
            r["decode_half_ms_per_token"] for r in split)
        assert row["advantage_ms_per_token"] == pytest.approx(advantage)
        assert row["formula_says_split_pays"] == (advantage > transfer_ms / n)
        assert row["measured_split_pays"] == (medians["split"] < medians["whole:A"])
        # The router's pick is what its decision record says it did.
        (routed,) = [r for r in runs if r["mode"] == "router"]
        d = routed["decision"]
        assert routed["router_pick"] == ("split" if d["split"] else "whole:A" if d["chosen"] == "cpu" else "whole:B")
        assert {(c["prefill"], c["decode"]) for c in d["split_candidates"]} == {("cpu", "cpu#2"), ("cpu#2", "cpu")}
        assert row["router_agrees"] == (medians[routed["router_pick"]] <= 1.05 * medians[row["fastest"]])
        assert row["backlog_held"]
    # A backlog on A is visible to the router: A's candidate counts its active requests.
    loaded = [r for r in data["rows"] if r["backlog"]]
    for row in loaded:
        (cand_a,) = [c for c in row["router_decision"]["candidates"] if c["worker"] == "cpu"]
        assert cand_a["active"] == row["backlog"]
    link = meta["link"]
    assert link["bytes"] == max(r["kv_bytes"] for r in data["rows"])
    assert link["plain_copy_mb_per_s"] > 0 and link["handoff_copy_mb_per_s"] > 0
    # CPU to CPU, both pools f32: the link carries the K/V bytes themselves, in A's write
    # alone, so its rate is at least the handoff's (which also counts B's import).
    assert link["link_bytes"] == link["bytes"] and link["link_mb_per_s"] >= link["handoff_copy_mb_per_s"]
    assert link["plain_over_link"] == pytest.approx(link["plain_copy_mb_per_s"] / link["link_mb_per_s"])
    assert link["transport"] == "landing"  # CPU workers: A writes into B's pages (kv_landing.py)
    assert link["at_start"]["measured_mb_per_s"] > 0


def test_a_prefix_cached_on_a_serves_whole_on_a_and_the_split_from_the_cache(results_dir, smollm2_path):
    from minivllm.bench.disaggregation import run

    (row,) = run(str(smollm2_path), ["cpu:1", "cpu:1"], prompts=[100], outputs=[4], backlogs=[0], cached_on_a=[70],
                 runs=1)
    assert row["cached_on_a"] == 64  # whole 16-token pages
    by_mode = {r["mode"]: r for r in row["runs"]}
    # Served on A, the prompt's prefix pages come from A's cache; B has never seen them.
    assert by_mode["whole:A"]["cached_prompt_tokens"] == 64
    assert by_mode["split"]["cached_prompt_tokens"] == 64
    assert by_mode["whole:B"]["cached_prompt_tokens"] == 0
    assert by_mode["split"]["kv_tokens"] == 96  # the prompt's full pages, cached or computed on A


def test_a_burst_at_a_worker_at_its_slot_cap(results_dir, smollm2_path):
    """A holds 2 long answers in its 2 slots; 3 requests arrive at once, routed cost+split,
    then cost, then each split by hand. The record's figures are recomputed from its own
    per-request entries; under `cost` nothing is split, by hand everything is, and every
    routed pick is what its decision's scores chose."""
    from minivllm.bench.disaggregation import run

    (row,) = run(str(smollm2_path), ["cpu:1", "cpu:1"], prompts=[64], outputs=[6], backlogs=[2], runs=1,
                 engine_options={"max_active_requests": 2}, burst=3)
    assert row["a_at_slot_cap"]
    (path,) = results_dir.glob("disaggregation-*.json")
    data = json.loads(path.read_text())
    burst = data["provenance"]["burst"]
    assert (burst["burst"], burst["backlog"], burst["prompt_tokens"], burst["max_tokens"]) == (3, 2, 64, 6)
    for policy, r in burst["policies"].items():
        e2e = [d["e2e_s"] for d in r["decisions"]]
        assert len(e2e) == 3 and r["e2e_s_median"] == pytest.approx(statistics.median(e2e))
        assert r["makespan_s"] >= max(e2e)
        assert sum(r["picks"].values()) == 3
        assert r["picks"]["split"] == sum(d["pick"] == "split" for d in r["decisions"])
        # The workers' own step counts over the burst: every answer's tokens after its first
        # were decode tokens on some worker (the backlog's come on top).
        steps = r["engine_steps"]
        assert sum(s["decode_tokens"] for s in steps.values()) >= 3 * 5
        assert all(s["steps"] > 0 and s["busy_ms_per_step"] > 0 and s["wall_ms_per_step"] > 0
                   for s in steps.values() if s["decode_tokens"])
        # Who held the cores: each local worker's process worked, and none beyond the host.
        cores = r["cores_busy"]
        assert all(0 < cores[name] <= cores["host_cores"] for name in steps)
        assert cores["host"] <= cores["host_cores"] * 1.05
        for name in steps:  # a thread is busy at most one core, and the busiest come first
            busiest = cores["busiest_threads"][name]
            assert busiest == sorted(busiest, reverse=True) and 0 < busiest[0] <= 1.05
        for d in r["decisions"]:  # B restored every block A moved (the burst's prompts share their start)
            if d["pick"] == "split":
                t = d["where_the_time_went"]
                assert t["kv_tokens"] > 0 and t["decode_restored_tokens"] >= t["kv_tokens"], t  # B may hold more
        if policy == "split":  # every request placed (A, B) by hand
            assert r["picks"]["split"] == 3
            continue
        for d in r["decisions"]:
            best_whole = min(d["whole"], key=d["whole"].get)
            if d["pick"] != "split":
                assert d["pick"] == ("whole:A" if best_whole == "cpu" else "whole:B")
            else:
                assert policy == "cost+split" and min(d["split"].values()) < 0.9 * d["whole"][best_whole]
    assert burst["policies"]["cost"]["picks"]["split"] == 0
    assert all(d["split"] == {} for d in burst["policies"]["cost"]["decisions"])
    ratio = burst["policies"]["cost+split"]["e2e_s_mean"] / burst["policies"]["cost"]["e2e_s_mean"]
    assert burst["mean_e2e_ratio"] == pytest.approx(ratio)
    forced = burst["policies"]["split"]["e2e_s_mean"] / burst["policies"]["cost"]["e2e_s_mean"]
    assert burst["all_split_mean_e2e_ratio"] == pytest.approx(forced)
    assert "## A burst: 3 requests at once" in path.with_name(path.name[:-5] + ".md").read_text()
