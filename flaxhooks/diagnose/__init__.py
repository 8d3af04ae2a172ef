"""What :class:`flaxhooks.Diagnose` reasons with: functions and watchers that turn statistics into
findings, and the pictures that show them.

``__all__`` is what users set; the other names are ``Diagnose``'s own and may change in any release.
"""

from flaxhooks.diagnose._attention import (
    ATTENTION,
    HEAD_COLUMNS,
    HEAD_MAXED,
    LOG_Z_COLUMNS,
    LOG_Z_MAXED,
    MAX_ENTROPY_LOGITS,
    SOWN_NAME,
    AttentionFigures,
    AttentionStats,
    AttentionThresholds,
    attention_figures,
    attention_findings,
    attention_interceptor,
    attention_layers,
    attention_logits,
    entropy_queries,
    log_z_figures,
    log_z_findings,
    log_z_stats,
    logit_stats,
    output_logits,
    record_attention,
)
from flaxhooks.diagnose._heatmap import (
    DPI,
    FIGURES_EXTRA,
    MISSING,
    NON_FINITE,
    Heatmaps,
    figure_pixels,
    figures_available,
    heatmap_figure,
    heatmap_png,
)
from flaxhooks.diagnose._instep import (
    COLUMNS,
    MAX_ENTRIES,
    MAX_PARAM_SAMPLES,
    MAX_ROWS,
    MIN_ROWS,
    SLOPE_BINS,
    WINDOW_ENTRIES,
    Window,
    add_windows,
    chosen_rows,
    layer_sums,
    rows_read,
    step_entries,
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
from flaxhooks.diagnose._spikes import (
    GradNormWatch,
    SpikeThresholds,
    first_spiked_layer,
)

__all__ = [
    "AttentionThresholds",
    "LossThresholds",
    "SpikeThresholds",
    "Thresholds",
    "record_attention",
]
