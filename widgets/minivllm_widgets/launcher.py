"""The launcher form: what a Cluster is started with, as widgets.

`options()` turns the form into `Cluster(...)` keyword arguments. The first rows hold
the controls used most; "all engine options" below them holds one control for every
other engine option, made from its declaration (`minivllm.engine.options`: help as the
tooltip, choices as a dropdown), so an option added to the engine appears here without
an edit. The cache controls are settled by the engine's own rule
(`engine_config.settle_cache_options`). Launch runs
`Cluster.start()` on a background thread (loading can take minutes on a T4) and records
progress and errors in plain state that the publisher shows; an error appears as one
line in the form, never as a traceback.
"""

from __future__ import annotations

import threading
import time

import ipywidgets as W

from minivllm.engine.engine_config import KV_MODES, PUBLICATIONS, SINGLE_FLIGHT, settle_cache_options
from minivllm.engine.options import option_default, option_fields, parse_option_value

_ENGINE_CONTROLS = ("kv_mode", "page_size", "max_model_len", "prefix_cache", "publication", "single_flight",
                    "draft_policy", "tv_budget", "batch_invariant")


def option_control(f, value):
    """A widget for one engine option from its declaration: a checkbox for a boolean, a
    dropdown for a fixed set of choices, else text read like KEY=VALUE values (blank = None)."""
    label = f.name.replace("_", " ")
    tip = f.metadata.get("help", "")
    if isinstance(f.default, bool):
        return W.Checkbox(value=bool(value), description=label, indent=False, tooltip=tip)
    choices = f.metadata.get("choices")
    if choices:
        return W.Dropdown(options=list(choices), value=value, description=label, tooltip=tip)
    return W.Text(value="" if value is None else str(value), description=label, tooltip=tip)


def control_value(widget):
    if isinstance(widget, W.Text):
        return parse_option_value(widget.value) if widget.value.strip() else None
    return widget.value


def detected_devices() -> list[str]:
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        gpus = 0
    return ["cpu"] + [f"cuda:{i}" for i in range(gpus)]


def cpu_workers(count: int, threads: int) -> list[str]:
    """`--inference-device` entries for `count` CPU workers: "cpu" (threads chosen by the
    cluster) when `threads` is 0, else "cpu:THREADS" each."""
    return [f"cpu:{threads}" if threads else "cpu"] * max(0, count)


class Launcher:
    def __init__(self, model: str = "smollm2-135m", devices: list[str] | None = None, **defaults):
        found = detected_devices()
        chosen = list(devices or found[:1])
        cpus = [d for d in chosen if d == "cpu" or d.startswith("cpu:")]
        threads = next((int(d.split(":")[1]) for d in cpus if ":" in d), 0)
        self.model = W.Text(value=model, description="model", placeholder="name, .gguf path or hub id")
        # Several CPU workers (each its own process and engine) need a count, not a checkbox.
        self.cpu_count = W.BoundedIntText(value=len(cpus), min=0, max=16, description="CPU workers")
        self.cpu_threads = W.BoundedIntText(value=threads, min=0, max=512, description="threads each (0: auto)",
                                            tooltip="0 = let the cluster split the free cores")
        self.devices = {d: W.Checkbox(value=d in chosen, description=d, indent=False) for d in found if d != "cpu"}
        self.dtype = W.Dropdown(options=["auto", "f32", "f16", "bf16"], value=defaults.get("dtype", "auto"),
                                description="activations")
        # Every engine control starts at the engine's own default (engine/options.py), so a
        # cluster launched here runs what `minivllm serve` or `Cluster(...)` would.
        d = {name: defaults.get(name, option_default(name)) for name in _ENGINE_CONTROLS}
        self.kv_mode = W.Dropdown(options=list(KV_MODES), value=d["kv_mode"], description="KV mode")
        self.page_size = W.BoundedIntText(value=d["page_size"], min=1, max=4096, description="page size")
        self.max_model_len = W.BoundedIntText(
            value=d["max_model_len"] or 0,
            min=0,
            max=131072,
            description="max len (0: auto)",
            tooltip="0 = the engine's default: min(model context, 4096)",
        )
        self.prefix_cache = W.Checkbox(value=d["prefix_cache"] is not False, description="prefix cache", indent=False)
        self.publication = W.Dropdown(options=list(PUBLICATIONS), value=d["publication"], description="publish")
        self.single_flight = W.Dropdown(options=list(SINGLE_FLIGHT), value=d["single_flight"],
                                        description="single-flight")
        self.draft_model = W.Text(value="", description="draft", placeholder="optional draft model")
        self.draft_policy = W.Text(value=d["draft_policy"] or "fixed", description="policy")
        self.tv_budget = W.BoundedFloatText(value=d["tv_budget"], min=0.0, max=1.0, step=0.05, description="TV budget")
        self.router = W.Dropdown(options=["cost", "round-robin", "least-loaded"], value="cost", description="router")
        # Ray: the same workers as actors on the nodes of a Ray cluster (Cluster(backend="ray")).
        self.backend = W.Dropdown(
            options=["local", "ray"], value=defaults.get("backend", "local"), description="backend"
        )
        self.ray_address = W.Text(value=defaults.get("ray_address") or "auto", description="Ray address",
                                  placeholder="auto, ray://HOST:10001, or local")
        self.batch_invariant = W.Checkbox(value=d["batch_invariant"], description="batch-invariant", indent=False)
        self.more = {f.name: option_control(f, defaults.get(f.name, option_default(f.name)))
                     for f in option_fields() if f.name not in _ENGINE_CONTROLS and f.metadata.get("flag", True)}
        more = W.Accordion([W.VBox(list(self.more.values()))])
        more.set_title(0, "all engine options")
        more.selected_index = None
        self.launch = W.Button(description="Launch", button_style="success")
        self.stop = W.Button(description="Stop", button_style="warning")
        self.status = W.HTML("<i>not running</i>")
        self.widget = W.VBox([
            W.HBox([self.model, self.dtype]),
            W.HBox([self.cpu_count, self.cpu_threads, W.Label("GPUs")] + list(self.devices.values())),
            W.HBox([self.kv_mode, self.page_size, self.max_model_len]),
            W.HBox([self.prefix_cache, self.publication, self.single_flight]),
            W.HBox([self.draft_model, self.draft_policy, self.tv_budget]),
            W.HBox([self.router, self.batch_invariant]),
            W.HBox([self.backend, self.ray_address]), more,
            W.HBox([self.launch, self.stop]), self.status])
        for control in self.widget.children:  # labels at their own width: "CPU workers", never "CPU work…"
            for w in getattr(control, "children", ()):
                if getattr(w, "description", "") and hasattr(w.style, "description_width"):
                    w.style.description_width = "initial"

    def options(self) -> dict:
        ray = self.backend.value == "ray"
        gpus = [d for d, box in self.devices.items() if box.value]
        # On Ray a GPU worker asks for "a GPU" (Ray picks which, on which node), and a CPU
        # worker for its threads' worth of CPUs (1 when the count is left to the cluster).
        devices = cpu_workers(self.cpu_count.value, self.cpu_threads.value or (1 if ray else 0)) + (
            ["gpu"] * len(gpus) if ray else gpus)
        opts = {"model": self.model.value.strip(), "devices": devices, "dtype": self.dtype.value,
                "router": self.router.value, "kv_mode": self.kv_mode.value, "page_size": self.page_size.value,
                "max_model_len": self.max_model_len.value or None, "batch_invariant": self.batch_invariant.value,
                "publication": self.publication.value,
                **settle_cache_options(self.kv_mode.value, self.prefix_cache.value, self.single_flight.value)}
        # The other options only where they differ from the engine's default.
        opts.update({name: value for name, w in self.more.items()
                     if (value := control_value(w)) != option_default(name)})
        if ray:
            address = self.ray_address.value.strip() or "auto"
            opts.update(backend="ray", ray_address=None if address == "local" else address)
        if self.draft_model.value.strip():
            opts.update(draft_model=self.draft_model.value.strip(), draft_policy=self.draft_policy.value.strip(),
                        tv_budget=self.tv_budget.value)
        return opts


class ClusterRunner:
    """Starts and stops a Cluster off the kernel's thread; state for the status panel."""

    def __init__(self):
        self.cluster = None
        self.phase = "idle"  # idle, starting, running, stopping, stopped, failed
        self.error: str | None = None
        # The cluster's last state, taken (fresh) as it stops: what the views keep showing.
        self.final_snapshot: dict | None = None
        self.stopped_at: float | None = None
        self.progress: dict[str, str] = {}
        self._lock = threading.Lock()

    def launch(self, options: dict) -> None:
        with self._lock:
            if self.phase in ("starting", "running", "stopping"):
                return
            self.phase, self.error, self.progress = "starting", None, {}
            self.final_snapshot = self.stopped_at = None
        threading.Thread(target=self._start, args=(dict(options),), name="minivllm-launch", daemon=True).start()

    def _start(self, options: dict) -> None:
        from minivllm.errors import MinivllmError
        from minivllm.serving import Cluster

        try:
            if not options.get("devices"):
                raise ValueError("no worker chosen: set CPU workers to 1 or more, or tick a GPU")
            model = options.pop("model")
            devices = options.pop("devices")
            cluster = Cluster(model, devices, on_progress=self._on_progress, **options)
            self.cluster = cluster
            cluster.start()
            self.phase = "running"
        except (MinivllmError, ValueError) as exc:
            self.phase, self.error, self.cluster = "failed", str(exc), None
        except Exception as exc:  # noqa: BLE001 - shown in the form, not as a traceback
            self.phase, self.error, self.cluster = "failed", f"{type(exc).__name__}: {exc}", None

    def _on_progress(self, worker: str, state: str, stage: str) -> None:
        self.progress[worker] = f"{state}: {stage}"

    def stop(self, wait: bool = False) -> None:
        """Stop the cluster (on a thread unless `wait`), keeping its final snapshot."""
        cluster = self.cluster
        if cluster is None or self.phase != "running":
            return
        self.phase = "stopping"

        def run():
            try:
                self.final_snapshot = cluster.snapshot(fresh=True)
            finally:
                cluster.stop()
                self.cluster, self.phase, self.stopped_at = None, "stopped", time.time()

        if wait:
            run()
        else:
            threading.Thread(target=run, name="minivllm-stop", daemon=True).start()

    def snapshot(self, fresh: bool = False) -> dict | None:
        """The running cluster's snapshot (`fresh`: asked of every worker now), or the
        final one of a stopped cluster, or None."""
        cluster = self.cluster
        if self.phase == "stopped":
            return self.final_snapshot
        if cluster is None or self.phase != "running":
            return None
        return cluster.snapshot(fresh=fresh)

    def status_view(self) -> tuple:
        return (self.phase, self.error, tuple(sorted(self.progress.items())))
