"""What ``Diagnose`` reasons with: pure functions and small host-side
watchers that turn statistics into findings (:class:`flaxhooks.Finding`),
and the pictures that show them. The callback itself is
:class:`flaxhooks.Diagnose`."""

from flaxhooks.diagnose._heatmap import (
    MISSING,
    NON_FINITE,
    Heatmaps,
    colormap,
    heatmap,
)
from flaxhooks.diagnose._instep import (
    COLUMNS,
    SLOPE_BINS,
    Window,
    add_windows,
    layer_sums,
    step_window,
    update_ratios,
)
from flaxhooks.diagnose._layers import (
    LayerFigures,
    Thresholds,
    layer_figures,
    layer_findings,
    param_findings,
)
from flaxhooks.diagnose._loss import (
    LossThresholds,
    LossWatch,
)
from flaxhooks.diagnose._setup import (
    DEFAULT_RNG_NAMES,
    CallSources,
    DropoutCall,
    Sources,
    call_sources,
    dropout_in_eval,
    output_sources,
    rng_streams,
    setup_findings,
)
from flaxhooks.writers import (
    encode_png,
)

__all__ = [
    "COLUMNS",
    "CallSources",
    "DEFAULT_RNG_NAMES",
    "DropoutCall",
    "Heatmaps",
    "LayerFigures",
    "LossThresholds",
    "LossWatch",
    "MISSING",
    "NON_FINITE",
    "SLOPE_BINS",
    "Sources",
    "Thresholds",
    "Window",
    "add_windows",
    "call_sources",
    "colormap",
    "dropout_in_eval",
    "encode_png",
    "heatmap",
    "layer_figures",
    "layer_findings",
    "layer_sums",
    "output_sources",
    "param_findings",
    "rng_streams",
    "setup_findings",
    "step_window",
    "update_ratios",
]
