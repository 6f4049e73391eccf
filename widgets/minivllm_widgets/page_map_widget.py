"""The live KV page map, painted in the browser from the page-state bytes.

`PageMap` is an anywidget: its `codes` trait (one byte per page, `page_grid.page_codes`)
travels as one binary buffer, and the JavaScript below paints a crisp canvas
(`image-rendering: pixelated`, a fixed width with wrapping rows, at most 300 px tall),
repainting only the cells whose byte changed. Hovering a cell names the page, its state, its
request holders and ref count, whether it is cached, and the requests whose block tables
hold it (`owners`, page id -> request ids, sent with the bytes). It also writes the counts per state that it
computed from the bytes it received into `data-counts` on its element, so a browser test
can check what was drawn against the snapshot.

Without anywidget (an image that lacks it, e.g. Kaggle's, where installing a frontend
extension mid-session would need a page reload) `make_page_map()` returns a PNG
`ipywidgets.Image` drawn in Python with the same layout and colours instead.
"""

from __future__ import annotations

import json

import ipywidgets as W

from minivllm_widgets.page_grid import COLOURS, MAX_HEIGHT_PX, SHARED2, STATES, WIDTH_PX, grid_layout, render_codes_png

_ESM = """
const STATES = %(states)s;
const COLOURS = %(colours)s;
function shade(code) {
  if (code < %(shared2)d) return COLOURS[code];
  const f = Math.max(0.45, 1.0 - 0.12 * (code - %(shared2)d));
  const [r, g, b] = COLOURS[%(shared2)d];
  return [Math.trunc(r * f), Math.trunc(g * f), Math.trunc(b * f)];
}
function bytesOf(v) {
  if (!v) return new Uint8Array(0);
  if (v instanceof DataView) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  if (ArrayBuffer.isView(v)) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
  return new Uint8Array(0);
}
function render({ model, el }) {
  const caption = document.createElement("div");
  caption.className = "minivllm-page-map-caption";
  caption.style.font = "12px sans-serif";
  el.appendChild(caption);
  const canvas = document.createElement("canvas");
  canvas.style.imageRendering = "pixelated";
  canvas.style.display = "block";
  el.classList.add("minivllm-page-map");
  el.appendChild(canvas);
  const ctx = canvas.getContext("2d");
  let last = null, lastLayout = "";
  function draw() {
    const codes = bytesOf(model.get("codes"));
    const pitch = model.get("pitch"), cols = model.get("columns");
    const n = codes.length, rows = Math.ceil(n / Math.max(1, cols));
    const gap = pitch >= 3 ? 1 : 0;
    const layout = `${n}/${pitch}/${cols}`;
    if (layout !== lastLayout) {
      canvas.width = cols * pitch + gap;
      canvas.height = rows * pitch + gap;
      canvas.style.width = canvas.width + "px";
      canvas.style.height = canvas.height + "px";
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      last = null;
      lastLayout = layout;
    }
    const counts = Object.fromEntries(STATES.map((s) => [s, 0]));
    for (let i = 0; i < n; i++) {
      const c = codes[i];
      counts[STATES[Math.min(c, %(shared2)d)]] += 1;
      if (last !== null && last[i] === c) continue;  // only what changed is repainted
      const [r, g, b] = shade(c);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect((i %% cols) * pitch + gap, Math.floor(i / cols) * pitch + gap, pitch - gap, pitch - gap);
    }
    last = codes.slice();
    el.dataset.counts = JSON.stringify(counts);
    el.dataset.pages = String(n);
    el.dataset.draws = String(Number(el.dataset.draws || 0) + 1);
  }
  // Hover: which page, its state, its holders and the requests whose block tables hold it.
  canvas.addEventListener("mousemove", (ev) => {
    const pitch = model.get("pitch"), cols = model.get("columns"), codes = bytesOf(model.get("codes"));
    const rect = canvas.getBoundingClientRect();
    const i = Math.floor((ev.clientY - rect.top) / pitch) * cols + Math.floor((ev.clientX - rect.left) / pitch);
    if (i < 0 || i >= codes.length) { canvas.title = ""; return; }
    const c = codes[i], holders = c >= %(shared2)d ? c - 2 : (c === 1 || c === 3 ? 1 : 0);
    const cached = c >= 2;  // the prefix index holds one reference to every cached page
    let owners = [];
    try { owners = JSON.parse(model.get("owners") || "{}")[String(i)] || []; } catch (e) { owners = []; }
    canvas.title = `page ${i}: ${STATES[Math.min(c, %(shared2)d)]}, ` +
      `${holders} request holder(s), ref count ${holders + (cached ? 1 : 0)}, ` +
      `${cached ? "in the prefix cache" : "not cached"}` + (owners.length ? `; requests: ${owners.join(", ")}` : "");
    el.dataset.hover = canvas.title;
  });
  const showCaption = () => { caption.innerHTML = model.get("caption"); };
  model.on("change:codes", draw);
  model.on("change:columns", draw);
  model.on("change:caption", showCaption);
  showCaption();
  draw();
}
export default { render };
""" % {"states": list(STATES), "colours": [list(COLOURS[s]) for s in STATES], "shared2": SHARED2}


def _anywidget_class():
    try:
        import anywidget
        import traitlets
    except ImportError:
        return None

    class PageMap(anywidget.AnyWidget):
        _esm = _ESM
        codes = traitlets.Bytes(b"").tag(sync=True)
        pitch = traitlets.Int(10).tag(sync=True)
        columns = traitlets.Int(60).tag(sync=True)
        caption = traitlets.Unicode("").tag(sync=True)
        owners = traitlets.Unicode("{}").tag(sync=True)  # JSON: page id -> request ids (the hover)

        def show(self, codes: bytes, caption: str, owners: dict | None = None) -> None:
            pitch, columns, _ = grid_layout(len(codes), WIDTH_PX, MAX_HEIGHT_PX)
            with self.hold_sync():  # one message: only the traits that changed, together
                if (pitch, columns) != (self.pitch, self.columns):
                    self.pitch, self.columns = pitch, columns
                self.codes = bytes(codes)
                self.caption = caption
                self.owners = json.dumps({str(k): v for k, v in (owners or {}).items()}, separators=(",", ":"))

    return PageMap


PageMap = _anywidget_class()


class PngPageMap(W.VBox):
    """The fallback: a caption and the same map as a PNG drawn in Python."""

    def __init__(self, **kwargs):
        self.caption, self.image = W.HTML(), W.Image(format="png")
        self._codes = None
        super().__init__([self.caption, self.image], **kwargs)

    def show(self, codes: bytes, caption: str, owners: dict | None = None) -> None:
        if self.caption.value != caption:
            self.caption.value = caption
        if codes != self._codes:
            self._codes = codes
            self.image.value = render_codes_png(codes) if codes else b""


def make_page_map(kind: str = "auto"):
    """"browser" (anywidget; an error without it), "png", or "auto" (browser when available)."""
    if kind not in ("auto", "browser", "png"):
        raise ValueError(f"page_map={kind!r}: choose 'auto', 'browser' or 'png'")
    if kind == "browser" and PageMap is None:
        raise ValueError("page_map='browser' needs anywidget (pip install anywidget); 'png' works without it")
    widget = PageMap() if kind != "png" and PageMap is not None else PngPageMap()
    widget.add_class("minivllm-page-map-widget")
    return widget
