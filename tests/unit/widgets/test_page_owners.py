"""The KV map's hover data: which requests hold which page, from the snapshot's block tables."""

from minivllm_widgets.panel_state import page_owners


def test_page_owners_lists_every_request_holding_a_page():
    snap = {"queues": {"running": [{"id": "r1", "block_table": [0, 1, 2]}, {"id": "r2", "block_table": [0, 1, 5]}],
                       "waiting": [{"id": "r3", "block_table": []}], "preempted": [{"id": "r4"}]}}
    assert page_owners(snap) == {0: ["r1", "r2"], 1: ["r1", "r2"], 2: ["r1"], 5: ["r2"]}


def test_static_page_map_is_a_plotly_heatmap_with_the_live_hover():
    """The static map (show_static): plotly's HTML read back; cells and hover words by hand."""
    import plotly_html

    from minivllm_widgets.html_views import kv_static_html
    from minivllm_widgets.page_grid import page_codes

    states = ["free", "owned", "shared", "cached-idle", "cached-in-use"]
    refs = [0, 1, 3, 1, 2]  # the shared page: two requests and the prefix index
    view = {"w": {"codes": page_codes(states, refs), "owners": {1: ["r1"], 2: ["r1", "r2"], 4: ["r2"]},
                  "counts": {}, "total": 5, "page_size": 16, "hits": 1, "lookups": 2, "restored_tokens": 16,
                  "flights": 0}}
    html = kv_static_html(view)
    assert "<img" not in html  # no picture drawn by our own code
    (fig,) = plotly_html.figures(html)
    (heatmap,) = fig["data"]
    assert heatmap["type"] == "heatmap" and heatmap["z"][0][:5] == [0, 1, 4, 2, 3]  # 4 = shared by two
    assert heatmap["text"][0][:5] == [
        "page 0: free, 0 request holder(s), ref count 0, not cached",
        "page 1: owned, 1 request holder(s), ref count 1, not cached; requests: r1",
        "page 2: shared, 2 request holder(s), ref count 3, in the prefix cache; requests: r1, r2",
        "page 3: cached-idle, 0 request holder(s), ref count 1, in the prefix cache",
        "page 4: cached-in-use, 1 request holder(s), ref count 2, in the prefix cache; requests: r2",
    ]


def test_static_page_map_stands_alone_or_inside_an_output_that_loads_plotly():
    # prefix_cache.ipynb displays it as an output of its own: plotly.js must come with it
    # (the browser reported "Plotly is not defined" when it did not); Workbench.static_html
    # loads plotly.js once at its top and asks for the map without it.
    from plotly.offline import get_plotlyjs

    from minivllm_widgets.html_views import kv_static_html
    from minivllm_widgets.page_grid import page_codes

    view = {"w": {"codes": page_codes(["free", "owned"], [0, 1]), "owners": {1: ["r1"]}, "counts": {}, "total": 2,
                  "page_size": 16, "hits": 0, "lookups": 0, "restored_tokens": 0, "flights": 0}}
    library = get_plotlyjs()[:2000]
    alone, inside = kv_static_html(view), kv_static_html(view, plotlyjs=False)
    assert alone.count(library) == 1 and alone.index(library) < alone.index("Plotly.newPlot")
    assert library not in inside and "Plotly.newPlot" in inside
