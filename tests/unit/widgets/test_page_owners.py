"""The KV map's hover data: which requests hold which page, from the snapshot's block tables."""

from minivllm_widgets.panel_state import page_owners


def test_page_owners_lists_every_request_holding_a_page():
    snap = {"queues": {"running": [{"id": "r1", "block_table": [0, 1, 2]}, {"id": "r2", "block_table": [0, 1, 5]}],
                       "waiting": [{"id": "r3", "block_table": []}], "preempted": [{"id": "r4"}]}}
    assert page_owners(snap) == {0: ["r1", "r2"], 1: ["r1", "r2"], 2: ["r1"], 5: ["r2"]}
