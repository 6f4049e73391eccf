"""The router's score table (widgets/decision_table.py) from a hand-made decision record:
one row per whole and split candidate with its terms as given, the chosen one marked,
escaped HTML."""

from __future__ import annotations

from minivllm_widgets.decision_table import decision_rows, decision_table_html

WHOLE = [{"worker": "cpu", "active": 4, "queued": 0, "prefill_s": 1.25, "decode_s": 3.5, "score": 4.75},
         {"worker": "cpu#2", "active": 0, "queued": 1, "prefill_s": None, "decode_s": None, "score": None}]
SPLITS = [{"prefill": "cpu", "decode": "cpu#2", "transfer_bytes": 47_185_920, "prefill_s": 1.25, "transfer_s": 0.1,
           "decode_s": 2.5, "score": 2.5, "break_even_ms_per_token": 3.125},
          {"prefill": "cpu#2", "decode": "cpu", "transfer_bytes": 47_185_920, "prefill_s": 1.3, "transfer_s": 0.1,
           "decode_s": 4.0, "score": 4.0, "break_even_ms_per_token": 3.125}]


def test_rows_and_chosen_split():
    d = {"chosen": "cpu", "split": {"prefill": "cpu", "decode": "cpu#2"}, "reason": "cost+split <b>",
         "candidates": WHOLE, "split_candidates": SPLITS}
    rows = decision_rows(d)
    assert [r["cells"] for r in rows] == [
        ["whole on cpu", "4 / 0", "1.250", "–", "3.500", "4.750", "–"],
        ["whole on cpu#2", "0 / 1", "–", "–", "–", "–", "–"],
        ["prefill cpu → decode cpu#2", "", "1.250", "0.1000 (47.2)", "2.500", "2.500", "3.1250"],
        ["prefill cpu#2 → decode cpu", "", "1.300", "0.1000 (47.2)", "4.000", "4.000", "3.1250"]]
    # the split was chosen, so the whole row of its prefill worker ("chosen": "cpu") is not marked
    assert [r["chosen"] for r in rows] == [False, False, True, False]
    page = decision_table_html(d, title="case <1>")
    assert "case &lt;1&gt;" in page and "cost+split &lt;b&gt;" in page and "<b>" not in page.replace("<b>case", "")
    assert page.count("minivllm-decision-row") == 4 and page.count("background:#e6f4ea") == 1


def test_whole_choice_marked():
    d = {"chosen": "cpu#2", "split": None, "reason": "cost", "candidates": WHOLE, "split_candidates": []}
    assert [r["chosen"] for r in decision_rows(d)] == [False, True]
