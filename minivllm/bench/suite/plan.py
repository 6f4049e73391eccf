"""`bench all`'s runs: SUITE expanded for the devices given (one subprocess command line each,
or a skip reason), checked against the registered drivers' own arguments."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from minivllm.bench.registry import command_parser
from minivllm.bench.suite.table import ALL, CPU, EACH, GPU, NONE, PAIR, SUITE, Bench, by_name

EXTRA_ARGS_ENV = "MINIVLLM_BENCH_ALL_EXTRA_ARGS"


def option_strings(p: argparse.ArgumentParser) -> set[str]:
    """Every option string a parser accepts (argparse lists them only in its actions)."""
    return {s for a in p._actions for s in a.option_strings}


@dataclass
class Run:
    """One planned subprocess."""
    name: str
    bench: str
    argv: list[str]                   # full command, starting with the Python executable
    devices: list[str]
    skip_reason: str | None = None
    record: dict = field(default_factory=dict)

    @property
    def cmdline(self) -> str:
        return shlex.join(self.argv)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda") or device.startswith("gpu")


def device_tag(devices: list[str]) -> str:
    return "-".join(d.replace(":", "") for d in devices) or "none"


def supported_dtypes(devices: list[str], capabilities: dict[str, tuple[int, int]] | None) -> list[str]:
    """f32 and f16 everywhere; bf16 on CPUs and on GPUs of sm_80 or newer (minivllm refuses
    it below). A GPU whose capability is unknown is assumed older (no bf16)."""
    dtypes = ["f32", "f16", "bf16"]
    for d in devices:
        if is_cuda(d) and (capabilities or {}).get(d, (0, 0)) < (8, 0):
            dtypes = ["f32", "f16"]
    return dtypes


def cuda_capabilities(devices: list[str]) -> dict[str, tuple[int, int]]:
    """Compute capability per CUDA device, asked in a child process so this process never
    holds a CUDA context while the benchmarks run."""
    cuda = [d for d in devices if is_cuda(d)]
    if not cuda:
        return {}
    code = ("import json,sys,torch\n"
            "from minivllm.devices import resolve_device\n"
            "out={}\n"
            "for d in sys.argv[1:]:\n"
            "    try:\n"
            "        out[d]=list(torch.cuda.get_device_capability(resolve_device(d)))\n"
            "    except Exception:\n"
            "        pass\n"
            "print(json.dumps(out))\n")
    try:
        res = subprocess.run([sys.executable, "-c", code, *cuda], capture_output=True, text=True, timeout=120)
        return {k: tuple(v) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return {}


def _pick(spec, devices: list[str]):
    if isinstance(spec, dict):
        return spec["cuda" if any(is_cuda(d) for d in devices) else "cpu"]
    return spec


def _expand(args, devices: list[str], options: set[str], ctx: dict, capabilities) -> list[str]:
    out: list[str] = []
    for a in args:
        if a == "{dtypes}":
            for dt in supported_dtypes(devices, capabilities):
                out += ["--activation-dtype", dt]
        elif a.startswith("?"):
            if a[1:] in options:
                out.append(a[1:])
        else:
            out.append(a.format(**ctx))
    return out


def _device_sets(bench: Bench, devices: list[str]) -> list[list[str]] | str:
    """The device lists of this benchmark's runs, or a skip reason."""
    if bench.devices == NONE:
        return [[]]
    if bench.devices == EACH:
        return [[d] for d in devices]
    if bench.devices == ALL:
        return [list(devices)]
    if bench.devices == PAIR:
        if len(devices) >= 2:
            return [list(devices)]
        if devices and is_cuda(devices[0]):
            return [[devices[0], "cpu"]]
        return [["cpu:1", "cpu:1"]]
    if bench.devices == GPU:
        cuda = [d for d in devices if is_cuda(d)]
        return [[d] for d in cuda] if cuda else "needs a CUDA device (none given)"
    if bench.devices == CPU:
        cpu = [d for d in devices if not is_cuda(d)]
        return [[cpu[0]]] if cpu else "CPU only (no CPU device given)"
    raise ValueError(f"unknown device mode {bench.devices!r}")


def plan(devices: list[str], *, quick: bool, only: list[str] | None = None, skip: list[str] | None = None,
         capabilities: dict | None = None,
         stamp: str = "STAMP", results_dir: str | None = None, python: str | None = None,
         extra_args: dict[str, list[str]] | None = None) -> list[Run]:
    """The runs of `bench all`, in SUITE order, skipped ones included (with a reason)."""
    from minivllm.bench.results import RESULTS_DIR

    names = by_name()
    for n in (only or []) + (skip or []):
        if n not in names:
            raise ValueError(f"unknown benchmark {n!r}; known: {', '.join(names)}")
    results = str(results_dir if results_dir is not None else RESULTS_DIR)
    extra_args = extra_args if extra_args is not None else _env_extra_args()
    python = python or sys.executable
    runs: list[Run] = []
    for b in SUITE:
        if only and b.name not in only:
            continue
        if skip and b.name in skip:
            continue
        sub = command_parser(b.argv)
        base = [python, "-m", "minivllm", *b.argv]
        if sub is None:
            if not b.optional or only:
                runs.append(Run(b.name, b.name, base, [], skip_reason=f"`{' '.join(b.argv)}` is not registered"))
            continue
        spec = b.quick if quick else b.full
        if spec is None:
            runs.append(Run(b.name, b.name, base, [], skip_reason="full suite only"))
            continue
        sets = _device_sets(b, devices)
        if isinstance(sets, str):
            runs.append(Run(b.name, b.name, base, [], skip_reason=sets))
            continue
        options = option_strings(sub)
        for devs in sets:
            ctx = {"results": results, "tag": device_tag(devs), "stamp": stamp}
            argv = base + _expand(_pick(spec, devs), devs, options, ctx, capabilities)
            if devs and "--inference-device" in options:
                for d in devs:
                    argv += ["--inference-device", d]
            argv += list(extra_args.get(b.name, []))
            name = b.name if len(sets) == 1 or not devs else f"{b.name}[{','.join(devs)}]"
            runs.append(Run(name, b.name, argv, devs))
    return runs


def _env_extra_args() -> dict[str, list[str]]:
    raw = os.environ.get(EXTRA_ARGS_ENV, "").strip()
    if not raw:
        return {}
    data = json.loads(raw)
    return {str(k): [str(x) for x in v] for k, v in data.items()}
