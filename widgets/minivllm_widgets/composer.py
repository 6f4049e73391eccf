"""The request composer: one prompt, a burst of copies, or a workload file from data/.

Each request's tokens are read on its own thread into plain state; the publisher shows
the latest requests' texts at its own pace, never per token."""

from __future__ import annotations

import html
import threading
from pathlib import Path

import ipywidgets as W

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


def workload_files() -> dict[str, Path]:
    """Prompt files shipped in data/ (one prompt per file, or one per line in .jsonl/.txt lists)."""
    if not DATA_DIR.is_dir():
        return {}
    return {str(p.relative_to(DATA_DIR)): p for p in sorted(DATA_DIR.rglob("*.txt")) if p.stat().st_size < 200_000}


class Composer:
    def __init__(self, runner, *, keep: int = 16):
        self.runner = runner
        self.keep = keep
        self.requests: dict[str, dict] = {}  # request id -> {worker, text, finish, prompt}
        self.error: str | None = None
        self._lock = threading.Lock()
        self.prompt = W.Textarea(value="Explain what a KV cache is in two sentences.", layout=W.Layout(width="100%"))
        self.max_tokens = W.BoundedIntText(value=64, min=1, max=8192, description="max tokens")
        self.temperature = W.BoundedFloatText(value=0.0, min=0.0, max=2.0, step=0.1, description="temperature")
        self.burst = W.BoundedIntText(value=8, min=1, max=256, description="burst of")
        # Instruction-tuned models answer a bare instruction with EOS at once: send it as a
        # chat (the model's own template) by default.
        self.chat = W.Checkbox(value=True, description="chat (apply the model's template)", indent=False)
        files = workload_files()
        self.workload = W.Dropdown(options=list(files) or ["(none)"], description="workload")
        self._files = files
        self.send = W.Button(description="Send")
        self.send_burst = W.Button(description="Send burst")
        self.send_workload = W.Button(description="Send workload")
        self.send.on_click(lambda _: self.submit([self.prompt.value]))
        self.send_burst.on_click(lambda _: self.submit([self.prompt.value] * self.burst.value))
        self.send_workload.on_click(lambda _: self.submit(self._workload_prompts()))
        self.widget = W.VBox(
            [
                self.prompt,
                W.HBox([self.max_tokens, self.temperature, self.chat]),
                W.HBox([self.send, self.burst, self.send_burst]),
                W.HBox([self.workload, self.send_workload]),
            ]
        )
        for w in (self.max_tokens, self.temperature, self.burst, self.workload):
            w.style.description_width = "initial"  # "temperature", never "temperat…"

    def _workload_prompts(self) -> list[str]:
        path = self._files.get(self.workload.value)
        return [path.read_text()] if path else []

    def submit(self, prompts: list[str]) -> list[str]:
        from minivllm.errors import MinivllmError
        from minivllm.sampling.sampling_params import SamplingParams

        cluster = self.runner.cluster
        if cluster is None or self.runner.phase != "running":
            self.error = "launch a cluster first"
            return []
        params = SamplingParams(max_tokens=self.max_tokens.value, temperature=self.temperature.value)
        ids = []
        try:
            for prompt in prompts:
                if self.chat.value:
                    stream = cluster.submit(None, params, messages=[{"role": "user", "content": prompt}])
                else:
                    stream = cluster.submit(prompt, params)
                with self._lock:
                    self.requests[stream.request_id] = {"worker": stream.worker, "text": "", "finish": None,
                                                        "prompt": prompt[:80], "tokens": 0,
                                                        "kind": "chat" if self.chat.value else "completion"}
                    for old in list(self.requests)[:-self.keep]:
                        del self.requests[old]
                threading.Thread(target=self._read, args=(stream,), daemon=True).start()
                ids.append(stream.request_id)
            self.error = None
        except MinivllmError as exc:
            self.error = str(exc)
        return ids

    def _read(self, stream) -> None:
        for event in stream:
            entry = self.requests.get(stream.request_id)
            if entry is None:
                return  # scrolled out of view; the request still runs to its end
            entry["text"] += event.text
            if event.token_id >= 0:
                entry["tokens"] += 1
            if event.finished:
                entry["finish"] = event.finish_reason if not event.error else f"error: {event.error}"

    def view(self) -> tuple:
        with self._lock:
            return (self.error, tuple((rid, r["worker"], r["text"], r["finish"], r["tokens"], r["kind"])
                                      for rid, r in self.requests.items()))


def composer_html(view: tuple) -> str:
    error, rows = view
    parts = [f"<div style='color:#c00'>{html.escape(error)}</div>"] if error else []
    for rid, worker, text, finish, tokens, kind in reversed(rows):
        state = f"finished: {finish}" if finish else "streaming…"
        hint = ""
        if finish and tokens == 0:
            hint = (" <span style='color:#c60'>0 tokens: the model ended at once"
                    + (" (a raw completion of an instruction often does: try chat)" if kind == "completion" else "")
                    + "</span>")
        parts.append(f"<div style='margin:4px 0;font:12px monospace'><b>{html.escape(rid)}</b> ({kind}) on "
                     f"{html.escape(str(worker))} [{html.escape(state)}, {tokens} tokens]{hint}"
                     f"<div style='white-space:pre-wrap'>{html.escape(text)}</div></div>")
    return "".join(parts) or "<i>nothing sent yet</i>"
