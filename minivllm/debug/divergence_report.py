"""What `debug.compare` found: per-token records, the first split, per-layer differences.

Plain dataclasses so a notebook can poke at them, `.to_dict()` for JSON (the CLI's
`--json` and the committed cases under data/divergence/), and `summary()` for a
human. `repr()` stays one line: a report holds hundreds of token records, and the
default dataclass repr would bury the one fact that matters (where the split is).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TopToken:
    token_id: int
    text: str
    logit: float


@dataclass
class SideToken:
    """One side's choice at one generated position, with the logits it was chosen from."""

    token_id: int
    text: str
    top: list[TopToken]  # the top-k of the raw float32 logits, best first
    margin: float  # top-1 logit minus top-2 logit: how close greedy was to choosing otherwise


def token_number(position: int) -> int:
    """How every text, widget and report numbers a generated token: from 1 (the first
    generated token is "generated token 1"). Records keep 0-based `position`s."""
    return position + 1


@dataclass
class PositionRecord:
    position: int  # index into the generated tokens (0 = first generated token)
    a: SideToken | None  # None when that side had already finished (EOS) before this position
    b: SideToken | None

    @property
    def same(self) -> bool:
        return self.a is not None and self.b is not None and self.a.token_id == self.b.token_id


@dataclass
class FirstDivergence:
    position: int  # generated-token index of the first differing token
    sequence_position: int  # the same position counted from the start of the prompt
    identical_tokens: int  # generated tokens both sides agreed on before the split (= position)
    identical_chars: int  # characters of those tokens' text
    shared_text: str  # the generated text both sides agree on
    a_token: TopToken | None  # what each side chose at the split (None: that side ended)
    b_token: TopToken | None
    a_margin: float | None
    b_margin: float | None
    a_continuation: str  # each side's text from the split on
    b_continuation: str


@dataclass
class LayerDiff:
    """How far side b's residual stream is from side a's after one layer.

    `rel_l2` is ||h_b - h_a|| / ||h_a||. "at_split" is the row whose logits chose the
    diverging token; "prefix" is every row from the first prompt token to that one,
    which is what the KV cache was built from.
    """

    layer: str  # "embedding", then "layer 0" .. "layer N-1" (the residual after that layer)
    at_split_max_abs: float
    at_split_rel_l2: float
    prefix_max_abs: float
    prefix_rel_l2: float
    first_differing_position: int | None  # earliest sequence position where this layer differs
    # False where the two sides' entries are not the same quantity (the report's layer_note
    # says why); its numbers are then NaN.
    comparable: bool = True


@dataclass
class ReplayCheck:
    """Whether the hidden-state replay reproduced what the engine computed at the split.

    The replay runs the same kernels with the same chunking through a contiguous KV
    cache; the engine may have used a paged one, whose attention can round differently.
    A large difference here means the per-layer table describes a nearby computation,
    not the engine's own.
    """

    a_token: int  # the replay's greedy choice at the split
    b_token: int
    a_top_logits_max_abs_diff: float | None  # replay vs engine over the engine's top-k ids (None: side ended)
    b_top_logits_max_abs_diff: float | None


@dataclass
class DivergenceReport:
    model: str
    model_path: str
    model_sha256: str
    device: str
    activation_dtype: str
    prompt: str | None  # None when the prompt was given as token ids
    chat: bool
    prompt_token_ids: list[int]
    a_options: dict  # as given
    b_options: dict
    a_settings: dict  # what each side ran with (kernel options resolved for the device, chunk size, kv mode)
    b_settings: dict
    max_tokens: int
    top_k: int
    a_token_ids: list[int]
    b_token_ids: list[int]
    a_text: str
    b_text: str
    records: list[PositionRecord]
    first_divergence: FirstDivergence | None
    layer_diffs: list[LayerDiff] = field(default_factory=list)  # empty when there is no divergence
    replay: ReplayCheck | None = None
    # Where it ran (obs.machine.cpu_fingerprint, plus the GPU on CUDA, and under "sides" each
    # side's engine, device and dtype): the split position is a fact about these kernels on
    # this processor, not about the code alone.
    machine: dict = field(default_factory=dict)
    # What the layer table covers when that is not the usual (no split, but different engines,
    # devices or dtypes), or why there is none (an engine without hidden states).
    layer_note: str | None = None
    # Where b's hidden states first differ from a's at all (exact comparison), over the
    # comparable layers: {"layer", "layer_index", "position", "in_prompt"}; None: nowhere.
    first_layer_difference: dict | None = None

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        for rec, out in zip(self.records, d["records"]):
            out["same"] = rec.same
        return d

    # -- reading ------------------------------------------------------------------------

    def __repr__(self) -> str:
        fd = self.first_divergence
        where = (
            "no divergence"
            if fd is None
            else f"split at generated token {token_number(fd.position)} after {fd.identical_chars} "
            "identical characters: "
            f"a={fd.a_token.text if fd.a_token else None!r} b={fd.b_token.text if fd.b_token else None!r}"
        )
        return (f"DivergenceReport({self.model}, a={_opts(self.a_options)}, b={_opts(self.b_options)}, "
                f"{len(self.records)} positions, {where})")

    def summary(self, *, max_layers: int | None = None) -> str:
        """The report as text: shared prefix, both continuations, top-k at the split, layer table."""
        lines = [
            f"model   {self.model} (sha256 {self.model_sha256[:16]}…), {self.device}, {self.activation_dtype}",
            f"a       {_opts(self.a_options)}   [ran with {_opts(self.a_settings)}]",
            f"b       {_opts(self.b_options)}   [ran with {_opts(self.b_settings)}]",
            f"machine {_machine(self.machine)}",
            f"prompt  {len(self.prompt_token_ids)} tokens{' (chat template)' if self.chat else ''}; "
            f"generated a={len(self.a_token_ids)} b={len(self.b_token_ids)} tokens (greedy, max {self.max_tokens})",
        ]
        fd = self.first_divergence
        if fd is None:
            lines.append("")
            lines.append(f"No divergence: both sides generated the same {len(self.a_token_ids)} tokens.")
            smallest = min((r for r in self.records if r.a is not None), key=lambda r: r.a.margin, default=None)
            if smallest is not None:
                lines.append(f"Closest call: generated token {token_number(smallest.position)}, a's top-1/top-2 margin "
                             f"{smallest.a.margin:.6f}.")
            lines += self._layer_lines(max_layers)
            lines += ["", "--- text ---", self.a_text]
            return "\n".join(lines)

        lines += [
            "",
            f"The sides agree on {fd.identical_tokens} generated tokens ({fd.identical_chars} characters), "
            f"then split at generated token {token_number(fd.position)} (sequence position {fd.sequence_position}).",
            "",
            "--- shared prefix (prompt, then generated) ---",
            (self.prompt if self.prompt is not None else "<prompt given as token ids>") + fd.shared_text,
            "--- a continues ---",
            fd.a_continuation,
            "--- b continues ---",
            fd.b_continuation,
            "",
            "top-k at the split (token id, text, logit):",
        ]
        rec = self.records[fd.position]
        rows = max(len(rec.a.top) if rec.a else 0, len(rec.b.top) if rec.b else 0)
        lines.append(f"  {'rank':<5}{'a':<42}{'b':<42}")
        for i in range(rows):
            lines.append(f"  {i + 1:<5}{_top_cell(rec.a, i):<42}{_top_cell(rec.b, i):<42}")
        lines.append(f"  margin (top-1 minus top-2): a {_fmt(fd.a_margin)}   b {_fmt(fd.b_margin)}")
        if self.replay is not None:
            r = self.replay
            lines.append(
                f"  replay check: greedy a={r.a_token} b={r.b_token}; top-k logits vs engine "
                f"max|Δ| a {_fmt(r.a_top_logits_max_abs_diff, '.3g')}, b {_fmt(r.b_top_logits_max_abs_diff, '.3g')}"
            )
        lines += self._layer_lines(max_layers)
        return "\n".join(lines)

    def _layer_lines(self, max_layers: int | None) -> list[str]:
        lines = []
        if self.layer_note:
            lines += ["", f"note: {self.layer_note}"]
        if self.layer_diffs:
            lines += ["", "residual stream, b vs a (rel L2 = ||b-a||/||a||):",
                      f"  {'after':<12}{'split max|Δ|':>14}{'split relL2':>13}{'prefix max|Δ|':>15}"
                      f"{'prefix relL2':>14}{'first pos':>11}"]
            diffs = self.layer_diffs
            if max_layers is not None and len(diffs) > max_layers:
                diffs = diffs[:max_layers // 2] + diffs[-(max_layers - max_layers // 2):]
            for d in diffs:
                if not d.comparable:
                    lines.append(f"  {d.layer:<12}{'not comparable (see the note)':>67}")
                    continue
                first = "-" if d.first_differing_position is None else str(d.first_differing_position)
                lines.append(f"  {d.layer:<12}{d.at_split_max_abs:>14.4g}{d.at_split_rel_l2:>13.3g}"
                             f"{d.prefix_max_abs:>15.4g}{d.prefix_rel_l2:>14.3g}{first:>11}")
            f = self.first_layer_difference
            if f is None:
                lines.append("  the hidden states are identical in every comparable layer")
            else:
                where = "a prompt token" if f["in_prompt"] else "a generated token"
                lines.append(f"  b first leaves a at {f['layer']}, sequence position {f['position']} ({where})")
        return lines

    def __str__(self) -> str:
        return self.summary()


def _opts(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items()) or "(defaults)"


def _fmt(x: float | None, spec: str = ".6f") -> str:
    return "-" if x is None else format(x, spec)


def _top_cell(side: SideToken | None, i: int) -> str:
    if side is None:
        return "(finished)" if i == 0 else ""
    if i >= len(side.top):
        return ""
    t = side.top[i]
    return f"{t.token_id:>6} {t.text!r:<20.20} {t.logit:.6f}"


def _machine(m: dict) -> str:
    if not m:
        return "not recorded"
    parts = [m.get("gpu") or m.get("cpu", "?"), f"torch {m.get('torch', '?')}"]
    sides = m.get("sides") or {}
    on_cpu = any(str(side.get("device")) == "cpu" for side in sides.values())
    if m.get("gpu") and on_cpu:
        parts.insert(1, m.get("cpu", "?"))
    if not m.get("gpu") or on_cpu:
        parts += [
            f"{m.get('torch_cpu_capability', '?')} kernels",
            m.get("blas", "?"),
            f"{m.get('torch_threads', '?')} threads",
        ]
    if sides:
        parts.append("sides " + " / ".join(f"{name}: {side.get('engine')} on {side.get('device')}, {side.get('dtype')}"
                                            for name, side in sides.items()))
    return ", ".join(parts)
