"""Engine options are declared once (EngineConfig / KernelSettings fields with `option`),
and every entry point reads them from there: the CLI flags of `generate` and `serve`, the
KEY=VALUE parser, the launcher widget's defaults. These tests fail when a command grows
its own copy of an option or its own default."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from minivllm.cli.main import build_parser
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.options import (
    add_engine_flags,
    engine_option_names,
    engine_options_from_args,
    option_default,
    parse_overrides,
)
from minivllm.errors import ConfigError


def test_every_option_is_declared_with_help_and_group():
    for f in fields(EngineConfig):
        assert f.metadata.get("help") and f.metadata.get("group"), f"{f.name} has no help or group"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_option_is_a_flag_with_the_engine_default(command):
    parser = build_parser()
    base = {"generate": [command, "hi"], "serve": [command]}[command]
    args = parser.parse_args(base)
    # Nothing given: no engine option in the namespace, so the engine's defaults apply.
    assert engine_options_from_args(args) == {}
    flags = [a for a in ("--" + n.replace("_", "-") for n in engine_option_names())]
    given = parser.parse_args(base + ["--page-size", "32", "--gemv-max-rows", "0", "--batch-invariant",
                                      "--prefix-cache", "off", "--dequant-cache", "auto", "--kv-mode", "contiguous"])
    assert engine_options_from_args(given) == {"page_size": 32, "gemv_max_rows": 0, "batch_invariant": True,
                                               "prefix_cache": False, "dequant_cache": "auto", "kv_mode": "contiguous"}
    help_text = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[
        1
    ].format_help()
    missing = [f for f in flags if f not in help_text]
    assert not missing, f"`minivllm {command}` lacks {missing}"


def test_a_bad_flag_value_is_refused_by_the_config_naming_the_field():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    options = engine_options_from_args(p.parse_args(["--policy", "lifo"]))
    with pytest.raises(ConfigError, match=r"policy.*allowed: fcfs"):
        EngineConfig(**options)


def test_overrides_parse_lists_strings_and_json_alike():
    assert parse_overrides(["gemv_max_rows=0", "kv_mode=paged"]) == {"gemv_max_rows": 0, "kv_mode": "paged"}
    assert parse_overrides("gemv_max_rows=0, batch_invariant=true") == {"gemv_max_rows": 0, "batch_invariant": True}
    assert parse_overrides('{"gemv_max_rows": 4096}') == {"gemv_max_rows": 4096}
    assert parse_overrides('kv_mode="paged"') == {"kv_mode": "paged"}  # the widgets write values JSON-quoted
    with pytest.raises(ConfigError, match="unknown engine option.*gemv_max_rows"):
        parse_overrides(["gemv_rows=0"])


def test_the_launcher_starts_from_the_engine_defaults():
    pytest.importorskip("ipywidgets")
    from minivllm_widgets.launcher import Launcher

    opts = Launcher(devices=["cpu"]).options()
    for name in ("kv_mode", "page_size", "publication", "single_flight", "batch_invariant"):
        assert opts[name] == option_default(name), name
    assert opts["max_model_len"] is None  # the engine's own default: min(model context, 4096)
    assert opts["dtype"] == "auto"


def test_cluster_and_serve_share_the_activation_dtype_default():
    import inspect

    from minivllm.serving.cluster import Cluster

    serve_args = build_parser().parse_args(["serve"])
    assert inspect.signature(Cluster).parameters["dtype"].default == serve_args.activation_dtype == "auto"


def test_a_new_option_reaches_the_launcher_the_llm_docstring_and_the_snapshot_schema(monkeypatch):
    """Declare one more kernel option (as `option(...)` on KernelSettings would) and find it
    in the three lists that used to be kept by hand."""
    pytest.importorskip("ipywidgets")
    from dataclasses import dataclass

    from minivllm.engine import llm as llm_module
    from minivllm.engine import snapshot
    from minivllm.kernels.kernel_options import KernelOptions, KernelSettings
    from minivllm.option_field import option
    from minivllm_widgets.launcher import Launcher

    # Without the new option, the docstrings are the derived ones.
    assert llm_module.LLM.__init__.__doc__ == llm_module.init_docstring()
    assert snapshot.__doc__ == snapshot.schema_doc(snapshot.DOC_TEMPLATE) and "cpu_gemv" in snapshot.__doc__
    assert "cpu_gemv" in llm_module.LLM.__init__.__doc__

    @dataclass
    class Declared:
        dummy_knob: int = option(7, "a kernel knob this test declares", "kernels")

    (declared,) = fields(Declared)
    for cls in (KernelSettings, KernelOptions, EngineConfig):
        monkeypatch.setitem(cls.__dataclass_fields__, "dummy_knob", declared)
    monkeypatch.setattr(KernelSettings, "dummy_knob", 7, raising=False)

    launcher = Launcher(devices=["cpu"])
    assert "dummy_knob" in launcher.more and "dummy_knob" not in launcher.options()  # the default: not sent
    launcher.more["dummy_knob"].value = "9"
    assert launcher.options()["dummy_knob"] == 9
    assert "dummy_knob" in llm_module.init_docstring()
    assert "dummy_knob" in snapshot.schema_doc(snapshot.DOC_TEMPLATE)
    assert KernelOptions().describe()["dummy_knob"] == 7  # the snapshot's kernels section: {**describe(), ...}


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous"])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("single_flight", ["off", "at_completion", "after_prefill"])
def test_settled_cache_options_are_what_the_config_accepts(kv_mode, prefix_cache, single_flight):
    """The launcher's cache controls, settled by engine_config.settle_cache_options: the
    result always passes EngineConfig's checks, and a combination the config accepts as
    given comes back unchanged."""
    from minivllm.engine.engine_config import settle_cache_options

    settled = settle_cache_options(kv_mode, prefix_cache, single_flight)
    EngineConfig(kv_mode=kv_mode, **settled)
    try:
        EngineConfig(kv_mode=kv_mode, prefix_cache=prefix_cache, single_flight=single_flight)
    except ConfigError:
        return
    assert settled == {"prefix_cache": prefix_cache, "single_flight": single_flight}
