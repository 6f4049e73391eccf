"""minivllm's notebook layer: widgets that launch workers and show the engine live.

Reads only minivllm's public snapshot and event API; minivllm never imports this package.
"""

from minivllm_widgets.divergence import DivergenceExplorer
from minivllm_widgets.divergence_views import report_html
from minivllm_widgets.page_grid import render_page_grid
from minivllm_widgets.publisher import Publisher
from minivllm_widgets.workbench import Workbench

__all__ = ["Workbench", "Publisher", "DivergenceExplorer", "report_html", "render_page_grid"]
