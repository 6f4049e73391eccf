"""The widget unit tests need the notebook extra (ipywidgets, plotly). Every machine that
runs `make test` has it; the offline GPU machine, which runs only `pytest -m cuda`, does
not: there these modules are left uncollected instead of erroring at import."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("ipywidgets") and importlib.util.find_spec("plotly") else ["*.py"]
