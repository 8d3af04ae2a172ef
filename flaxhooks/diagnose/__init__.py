"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

from flaxhooks.diagnose._instep import COLUMNS, SLOPE_BINS, Window, add_windows, layer_sums, step_window
from flaxhooks.diagnose._layers import LayerFigures, Thresholds, layer_figures, layer_findings, param_findings

__all__ = [
    "COLUMNS",
    "SLOPE_BINS",
    "LayerFigures",
    "Thresholds",
    "Window",
    "add_windows",
    "layer_figures",
    "layer_findings",
    "layer_sums",
    "param_findings",
    "step_window",
]
