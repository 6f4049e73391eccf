"""A GEMV launch table of a test's own, read by kernels/gemv_configs.py in place of the
committed one while the block runs: `with gemv_table(tmp_path, monkeypatch, {"sm90":
{"configs": {...}}}):` (a fixture yields inside it)."""

from __future__ import annotations

import contextlib
import json


@contextlib.contextmanager
def gemv_table(tmp_path, monkeypatch, table: dict):
    from minivllm.kernels import gemv_configs

    path = tmp_path / "gemv_configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(gemv_configs.TABLE_ENV, str(path))
    gemv_configs.reload_table()  # an earlier test may have loaded another table
    try:
        yield path
    finally:
        monkeypatch.undo()
        gemv_configs.reload_table()
