"""`minivllm bench all`: the suite covers every registered benchmark, every planned command
parses, a quick run writes its index with the sub-benchmark's result files, and a failing
sub-benchmark is reported while the others still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minivllm.bench import registry, suite
from minivllm.cli.main import build_parser, main


def _suite_commands() -> set[tuple[str, ...]]:
    return {b.argv for b in suite.SUITE}


def _registered() -> set[str]:
    return {d.name for d in registry.bench_drivers()}


def test_every_bench_subcommand_is_in_the_suite():
    """A new `minivllm bench X` driver that is not in suite.SUITE (nor excluded with a reason) fails here."""
    registered = _registered()
    covered = {argv[1] for argv in _suite_commands() if argv[0] == "bench"}
    missing = registered - covered - set(suite.EXCLUDED)
    assert not missing, (
        f"add these to minivllm/bench/suite/table.py SUITE (or EXCLUDED with a reason): {sorted(missing)}"
    )
    assert set(suite.EXCLUDED) <= registered, "stale exclusions"
    assert ("smoke",) in _suite_commands()  # the top-level smoke command runs too
    names = [b.name for b in suite.SUITE]
    assert len(names) == len(set(names))


def test_dry_run_lists_every_registered_benchmark(capsys):
    assert (
        main(["bench", "all", "--quick", "--dry-run", "--inference-device", "cpu", "--inference-device", "cuda:0"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split(":")[0].split("[")[0] for line in lines if not line.startswith("#")}
    registered = _registered() - set(suite.EXCLUDED)
    for sub in registered:
        benches = [b.name for b in suite.SUITE if b.argv == ("bench", sub)]
        assert benches and set(benches) & listed, f"bench {sub} is not in the dry-run plan"
        planned = [line for line in lines if f" -m minivllm bench {sub} " in line + " "]
        assert planned or sub == "kernels", f"bench {sub}: no command planned"  # kernels: GPU only, planned above
    assert any(" -m minivllm smoke " in line for line in lines)
    assert sum("NOT IMPLEMENTED" in line for line in lines) == len(suite.NOT_IMPLEMENTED)


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("devices,caps", [(["cpu"], {}), (["cuda:0"], {"cuda:0": (7, 5)}),
                                          (["cpu", "cuda:0", "cuda:1"], {"cuda:0": (9, 0), "cuda:1": (9, 0)})])
def test_every_planned_command_parses(quick, devices, caps):
    parser = build_parser()
    runs = suite.plan(devices, quick=quick, capabilities=caps, extra_args={})
    assert runs
    for r in runs:
        if r.skip_reason:
            continue
        assert r.argv[1:3] == ["-m", "minivllm"]
        args = parser.parse_args(r.argv[3:])  # exits (fails the test) on an unknown or bad argument
        assert callable(args.func)
        dtypes = [r.argv[i + 1] for i, a in enumerate(r.argv) if a == "--activation-dtype"]
        if "bf16" in dtypes:  # refused below sm_80
            assert all(not suite.is_cuda(d) or caps.get(d, (0, 0)) >= (8, 0) for d in r.devices), r.cmdline
    by = {r.name: r for r in runs}
    if devices == ["cpu"]:
        assert by["kernels"].skip_reason and by["routing"].devices == ["cpu:1", "cpu:1"]
    if devices == ["cuda:0"]:
        assert by["routing"].devices == ["cuda:0", "cpu"] and not by["kernels"].skip_reason


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown benchmark"):
        suite.plan(["cpu"], quick=True, only=["nope"], extra_args={})
    runs = suite.plan(["cpu"], quick=True, skip=["soak", "serve"], extra_args={})
    assert {"soak", "serve"}.isdisjoint(r.name for r in runs)


def _bench_all(cwd, *extra, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != suite.EXTRA_ARGS_ENV}
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm", "bench", "all", "--quick", "--inference-device", "cpu", *extra],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = cwd / "benchmarks" / "results"
    index = sorted(results.glob("bench-all-cpu-*.json"))
    assert len(index) == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert index[0].with_suffix(".md").exists()
    return proc, json.loads(index[0].read_text()), index[0].with_suffix(".md").read_text()


def test_quick_run_writes_the_index(tmp_path, smollm2_path):
    proc, data, md = _bench_all(tmp_path, "--only", "gguf-open")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["benchmark"] == "bench-all" and data["provenance"]["settings"]["mode"] == "quick"
    assert {"commit", "date", "device", "torch"} <= set(data["provenance"])
    (rec,) = data["runs"]
    assert rec["name"] == "gguf-open" and rec["status"] == "ok" and rec["exit_code"] == 0 and rec["seconds"] > 0
    assert rec["cmdline"].split()[1:5] == ["-m", "minivllm", "bench", "gguf-open"]
    files = sorted(os.path.basename(f) for f in rec["result_files"])
    assert len(files) == 2 and all(f.startswith("gguf-open-") for f in files)
    assert {os.path.splitext(f)[1] for f in files} == {".json", ".md"}
    assert all((tmp_path / f).exists() for f in rec["result_files"])
    assert "| gguf-open | ok |" in md and files[0] in md
    # run outside the repository: the runs and the index still name the package's commit
    commit = suite.package_commit()
    if commit:
        result_json = next(tmp_path / f for f in rec["result_files"] if f.endswith(".json"))
        sub_commit = json.loads(result_json.read_text())["provenance"]["commit"]
        assert data["provenance"]["commit"] == sub_commit and sub_commit.split("-")[0] == commit.split("-")[0]


def test_a_failing_benchmark_is_reported_and_the_rest_still_run(tmp_path, smollm2_path):
    inject = {"gguf-open": ["--no-such-flag"], "decode": ["--prompt-tokens", "16", "--max-tokens", "4"]}
    proc, data, md = _bench_all(tmp_path, "--only", "gguf-open,decode",
                                env_extra={suite.EXTRA_ARGS_ENV: json.dumps(inject)})
    assert proc.returncode == 1
    first, second = data["runs"]
    assert first["name"] == "gguf-open" and first["status"] == "failed" and first["exit_code"] == 2
    assert any("--no-such-flag" in line for line in first["output_tail"]) and not first["result_files"]
    assert second["name"] == "decode" and second["status"] == "ok", second
    assert any(os.path.basename(f).startswith("decode-smollm2-135m-") for f in second["result_files"])
    assert "| gguf-open | failed (exit 2) |" in md and "| decode | ok |" in md
    assert "failed (gguf-open)" in proc.stdout
