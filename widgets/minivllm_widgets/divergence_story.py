"""One comparison, told once: the explorer's sentences, from the numbers its charts draw.

Every position is said as "generated token N" with N from `minivllm.debug.token_number`
(the report's text and the notebooks use the same function). Magnitudes are computed from
`chart_data.layer_chart` / `chart_data.margin_chart`, the same series the plotly figures
draw (live and static), and put in words against the rounding of each float format.
"""

from __future__ import annotations

import math

from minivllm.debug.divergence_report import token_number
from minivllm_widgets.chart_data import layer_chart

TIE_RULE = "greedy argmax takes the lowest token id among equal logits (torch.argmax returns the first maximum)"

# Relative error one rounding step leaves in each format (half its machine epsilon), and
# what a whole forward pass accumulates from it in practice: a few hundred times more.
ROUNDING_LEVELS = (  # (upper bound on a relative L2, words)
    (0.0, "identical"),
    (1e-4, "at the level of float32 rounding (float32 keeps about 7 significant digits)"),
    (5e-3, "at the level of float16 rounding (float16 keeps about 3 significant digits)"),
    (5e-2, "at the level of bfloat16 rounding (bfloat16 keeps about 2 significant digits)"),
)


def magnitude_words(rel: float | None) -> str:
    """A relative difference in words: '3.1e-06, at the level of float32 rounding ...',
    'about 2.3%, at the level of bfloat16 rounding ...', or 'about 40%: more than rounding'."""
    if rel is None or not math.isfinite(rel):
        return "not measured"
    if rel == 0.0:
        return "identical (relative L2 exactly 0)"
    size = f"{rel:.1e}" if rel < 1e-3 else f"about {rel * 100:.2g}%"
    for bound, words in ROUNDING_LEVELS[1:]:
        if rel <= bound:
            return f"{size}, {words}"
    return f"{size}: more than rounding alone explains (a different computation, not just a different order)"


def largest_layer_difference(report) -> tuple[str, float] | None:
    """(layer, relative L2) of the largest whole-prefix value the layer chart draws."""
    chart = layer_chart(report)
    if chart is None:
        return None
    prefix = chart.series[0]
    drawn = [(x, y) for x, y in zip(prefix.x, prefix.y) if y is not None]
    if not drawn:
        all_zero = any(getattr(d, "comparable", True) for d in report.layer_diffs)
        return (report.layer_diffs[-1].layer, 0.0) if all_zero else None
    return max(drawn, key=lambda xy: xy[1])


def is_tie(tok) -> bool:
    return tok is not None and tok.margin == 0.0


def tie_words(tok) -> str:
    """'an exact tie between ' ... ' (ids 5 and 9), broken by the rule'."""
    if len(tok.top) < 2:
        return "an exact tie"
    first, second = tok.top[0], tok.top[1]
    return (f"an exact tie between {first.text!r} (id {first.token_id}) and {second.text!r} (id {second.token_id}) "
            f"at logit {first.logit:.4f}, broken by the rule: {TIE_RULE}")


def margin_words(tok) -> str:
    if is_tie(tok):
        return tie_words(tok)
    if not math.isfinite(tok.margin):
        return "the only token allowed there (every other token was masked)"
    return f"a margin of {tok.margin:.4g} logits"


def choice_words(side: str, tok) -> str:
    if tok is None:
        return f"side {side} has already ended"
    second = tok.top[1].text if len(tok.top) > 1 and math.isfinite(tok.margin) else None
    if is_tie(tok):
        return f"side {side} picks {tok.text!r} in {tie_words(tok)}"
    return (
        f"side {side} picks {tok.text!r} as {margin_words(tok)}"
        if not math.isfinite(tok.margin)
        else f"side {side} picks {tok.text!r} by {margin_words(tok)}"
        + (f" over {second!r}" if second is not None else "")
    )


def _closest(report, before: int | None = None):
    recs = [r for r in report.records[:before] if r.a is not None and math.isfinite(r.a.margin)]
    return min(recs, key=lambda r: r.a.margin, default=None)


def _layer_sentence(report) -> str:
    largest = largest_layer_difference(report)
    if largest is None:
        return ""
    layer, rel = largest
    return (f" Side b's hidden states differ from a's by {magnitude_words(rel)}"
            f" (the largest relative L2 over the prefix, after {layer}).")


def summary_sentence(report) -> str:
    """The report in plain words (the explorer's first line): where the sides part, how
    close the call was, and how far apart the hidden states were, in words."""
    fd = report.first_divergence
    if fd is None:
        n = len(report.a_token_ids)
        out = f"The runs agree on all {n} generated tokens: no divergence."
        close = _closest(report)
        if close is not None:
            out += (f" The closest call was generated token {token_number(close.position)} ({close.a.text!r}), "
                    f"{margin_words(close.a)}.")
        out += _layer_sentence(report)
        left = getattr(report, "first_layer_difference", None)
        if left is not None:
            out += (f" b first leaves a at {left['layer']}, sequence position {left['position']} "
                    f"({'in the prompt' if left['in_prompt'] else 'a generated token'}).")
        return out
    rec = report.records[fd.position]
    agree = (f"The runs agree for {fd.identical_tokens} tokens; at generated token {token_number(fd.position)}"
             if fd.identical_tokens else f"The runs part at once: at generated token {token_number(fd.position)}")
    out = f"{agree} {choice_words('a', rec.a)}, while {choice_words('b', rec.b)}."
    first = next((d for d in report.layer_diffs if d.first_differing_position is not None), None)
    if first is not None:
        split_row = fd.sequence_position - 1  # the row whose logits chose the diverging token
        where = (f"the hidden states already differed from {first.layer} at sequence position "
                 f"{first.first_differing_position} (of {len(report.prompt_token_ids)} prompt tokens)")
        if first.first_differing_position < split_row:
            out += f" {where[0].upper()}{where[1:]}, and that difference was in the KV cache before the split."
        else:
            out += f" {where[0].upper()}{where[1:]}: the difference arose at the split row itself."
        out += _layer_sentence(report)
    elif report.layer_diffs:
        out += " The hidden states were identical up to the split row: only the final logits differed."
    return out


def starting_position(report) -> int:
    """Where the explorer's token slider starts (0-based): the split, else the closest call."""
    if report.first_divergence is not None:
        return report.first_divergence.position
    close = _closest(report)
    return 0 if close is None else close.position
