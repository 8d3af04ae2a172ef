"""A statistic over layers (rows, the first at the top) and steps (columns) as a heatmap,
drawn with matplotlib (:data:`FIGURES_EXTRA`)."""

from __future__ import annotations

import functools
import importlib.util
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: How to install what draws the heatmaps.
FIGURES_EXTRA = "pip install 'flaxhooks[figures]'"
#: A cell whose value is NaN or infinite.
NON_FINITE = "#e22424"
#: A cell with no value (a layer not measured at that step).
MISSING = "#c8c8c8"
#: The colour map: perceptually uniform, dark for low values.
COLORMAP = "viridis"
#: Pixels per inch of the pictures.
DPI = 100
#: The most columns drawn: more steps share columns (their mean), none resampled away.
MAX_COLUMNS = 512
_MAX_ROW_LABELS, _STEP_TICKS, _NAME_LENGTH = 40, 8, 32


def figures_available() -> bool:
    """Whether matplotlib is installed (without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def _need_matplotlib() -> None:
    if not figures_available():
        raise ImportError(f"heatmaps are drawn with matplotlib, which is not installed: {FIGURES_EXTRA}")


class _Cells(NamedTuple):
    """What a heatmap shows: ``values`` masked where missing or non-finite, the colour bar's ends,
    whether it is a log scale, and whether every finite value is the same."""

    values: np.ma.MaskedArray
    missing: np.ndarray
    nonfinite: np.ndarray
    low: float
    high: float
    log: bool
    constant: bool


def _cells(values: np.ndarray, missing: np.ndarray | None, log: bool, vmin: float | None,
           vmax: float | None, columns: int) -> _Cells:
    """The cells of ``values[layer, step]``: a log scale where asked and the range spans a decade."""
    values = np.asarray(values, np.float64)
    values = values[None] if values.ndim == 1 else values
    if values.ndim != 2 or not values.size:
        raise ValueError(f"a heatmap needs values [layers, steps], not an array of shape {values.shape}")
    missing = np.broadcast_to(np.asarray(False if missing is None else missing, bool), values.shape)
    finite = ~missing & np.isfinite(values)
    usable = finite & (values > 0) if log else finite
    found = values[usable]
    found_low, found_high = (found.min(), found.max()) if found.size else (1.0, 10.0) if log else (0.0, 1.0)
    low = float(vmin) if vmin is not None else float(min(found_low, np.inf if vmax is None else vmax))
    high = float(vmax) if vmax is not None else float(max(found_high, low))
    if log and low <= 0:
        raise ValueError(f"a log scale starts above 0, not at {low}")
    if high < low:
        raise ValueError(f"the scale ends ({high}) below its start ({low})")
    # Every finite value the same (on a log scale, none <= 0 besides): the bar says so.
    constant = bool(found.size and found.min() == found.max() == low == high and (usable == finite).all())
    if high == low:  # a range of one value: that value in the middle of the map
        pad = max(abs(low), 1.0) / 2
        low, high = (low / 10**0.5, high * 10**0.5) if log else (low - pad, high + pad)
    drawn = np.where(usable, values, low)  # on a log scale, values <= 0 take the lowest colour
    nonfinite = ~missing & ~np.isfinite(values)
    log = log and high / low >= 10  # less than a decade reads better on a linear scale
    if values.shape[1] > columns:
        drawn, nonfinite, missing = _merge_columns(drawn, nonfinite, missing, columns, log)
    return _Cells(np.ma.masked_array(drawn, nonfinite | missing), missing, nonfinite, low, high, log,
                  constant)


def _merge_columns(values: np.ndarray, nonfinite: np.ndarray, missing: np.ndarray, columns: int,
                   log: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of neighbouring columns as one: their (geometric on a log scale) mean; non-finite if
    any is, missing if all are."""
    starts = np.linspace(0, values.shape[1], columns + 1).round().astype(int)[:-1]
    ok = ~(nonfinite | missing)
    x = np.log10(np.where(ok, values, 1.0)) if log else np.where(ok, values, 0.0)
    counts = np.add.reduceat(ok.astype(np.int64), starts, axis=1)
    mean = np.add.reduceat(np.where(ok, x, 0.0), starts, axis=1) / np.maximum(counts, 1)
    return (10.0**mean if log else mean, np.logical_or.reduceat(nonfinite, starts, axis=1),
            np.logical_and.reduceat(missing, starts, axis=1))


def _short(name: str) -> str:
    return name if len(name) <= _NAME_LENGTH else "\u2026" + name[-(_NAME_LENGTH - 1):]


def heatmap_figure(values: np.ndarray, *, log: bool = True, vmin: float | None = None,
                   vmax: float | None = None, missing: np.ndarray | None = None,
                   rows: Sequence[str] | None = None, steps: Sequence[int] | None = None,
                   title: str | None = None, columns: int = MAX_COLUMNS) -> Figure:
    """The heatmap of ``values[layer, step]``, a matplotlib ``Figure`` made without pyplot (any thread).

    Args:
        values: ``[layers, steps]``; NaN and infinities are drawn in :data:`NON_FINITE`.
        log: colour by ``log10(value)`` (values <= 0: the lowest colour) where the range spans a decade.
        vmin, vmax: the values of the lowest and highest colours (default: the finite values' range).
        missing: ``[layers, steps]``, True where a layer has no value (drawn :data:`MISSING`).
        rows: the layers' names.
        steps: each column's step (default: 0, 1, ...).
        columns: the most columns drawn: beyond it neighbouring steps share one.
    """
    _need_matplotlib()
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, LogNorm, Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if columns < 1:
        raise ValueError(f"a heatmap draws at least 1 column, not {columns}")
    cells = _cells(values, missing, log, vmin, vmax, columns)
    n_rows, n_columns = cells.values.shape
    names = [_short(str(name)) for name in rows] if rows is not None else [str(i) for i in range(n_rows)]
    if len(names) != n_rows:
        raise ValueError(f"{len(names)} row names for {n_rows} rows")
    steps = list(range(values.shape[-1])) if steps is None else [int(step) for step in steps]
    if len(steps) != np.shape(values)[-1]:
        raise ValueError(f"{len(steps)} steps for {np.shape(values)[-1]} columns")
    starts = np.linspace(0, len(steps), n_columns + 1).round().astype(int)[:-1]  # merged: the first step
    # In inches: at least about TensorBoard's card (it scales a picture down to fit, not up).
    name_width = 0.06 * max((len(name) for name in names), default=0)
    size = (min(max(2.6 + name_width + 0.03 * n_columns, 4.0), 14.0), min(max(1.2 + 0.2 * n_rows, 2.4), 11.0))
    figure = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(figure)
    # Margins from the labels' lengths: constrained layout draws the figure twice.
    special_row = 0.3 if (cells.nonfinite.any() or cells.missing.any()) else 0.0
    left = (0.25 + 0.065 * max((len(name) for name in names), default=1)) / size[0]
    bottom = (0.45 + special_row) / size[1]
    top = 1 - (0.35 if title else 0.15) / size[1]
    figure.subplots_adjust(left=left, right=1 - 0.75 / size[0], bottom=bottom, top=top)
    axes = figure.add_subplot()
    colormap = matplotlib.colormaps[COLORMAP].with_extremes(bad=MISSING)
    norm = LogNorm(cells.low, cells.high) if cells.log else Normalize(cells.low, cells.high)
    image = axes.imshow(cells.values, cmap=colormap, norm=norm, aspect="auto", interpolation="nearest")
    # Non-finite cells over the map in their own colour (the map's bad colour is for missing ones).
    axes.imshow(np.ma.masked_array(np.zeros(cells.values.shape), ~cells.nonfinite),
                cmap=ListedColormap([NON_FINITE]), vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    every = math.ceil(n_rows / _MAX_ROW_LABELS)  # a label per row while they fit
    axes.set_yticks(range(0, n_rows, every), names[::every], fontsize=8)
    ticks = np.unique(np.linspace(0, n_columns - 1, min(n_columns, _STEP_TICKS)).round().astype(int))
    axes.set_xticks(ticks, [str(steps[starts[i]]) for i in ticks], fontsize=8)
    axes.set_xlabel("step", fontsize=8)
    if title:
        axes.set_title(title, fontsize=10)
    if cells.constant:  # the bar is the one value's colour, not a spread no cell has
        value = float(np.ma.min(cells.values))
        bar = figure.colorbar(ScalarMappable(norm, ListedColormap([colormap(norm(value))])), ax=axes)
        bar.minorticks_off()
        bar.set_ticks([value], labels=[f"{value:.3g}"])
        bar.set_label(f"every {'finite ' * bool(cells.nonfinite.any())}value is {value:.3g}", fontsize=8)
    else:
        bar = figure.colorbar(image, ax=axes)
    bar.ax.tick_params(labelsize=8)
    special = [Patch(color=color, label=label) for color, label, shown in (  # the colours of no value
        (NON_FINITE, "non-finite", cells.nonfinite.any()), (MISSING, "no value", cells.missing.any()))
        if shown]
    if special:
        figure.legend(handles=special, loc="lower right", ncols=len(special), fontsize=8, frameon=False,
                      borderaxespad=0.1)
    return figure


def heatmap_png(values: np.ndarray, **options: Any) -> bytes:
    """The PNG file of :func:`heatmap_figure`."""
    figure = heatmap_figure(values, **options)
    with io.BytesIO() as png:
        figure.savefig(png, format="png", dpi=DPI)
        return png.getvalue()


def figure_pixels(figure: Figure) -> np.ndarray:
    """A figure drawn as uint8 RGB pixels ``[H, W, 3]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class Heatmaps:
    """The history of one statistic per layer (rows in the order they first appear), as a heatmap of
    at most ``columns`` columns: a full one merges neighbouring columns pairwise.

    Args:
        log: merged steps take the geometric mean (else the mean); the picture is coloured by ``log10``.
    """

    def __init__(self, columns: int = 256, *, log: bool = True):
        if columns < 2:
            raise ValueError(f"a heatmap keeps at least 2 columns, not {columns}")
        self.columns, self.log = columns, log
        self._layers: dict[str, None] = {}  # in the order first seen
        self._steps: list[int] = []  # each column's first step
        self._cells: list[dict[str, list[Any]]] = []  # per column: {layer: [sum, count, non-finite]}
        self._stride, self._filled = 1, 0  # steps a full column gathers; the last one's

    @property
    def layers(self) -> list[str]:
        """The rows' layers, in the order they first appeared."""
        return list(self._layers)

    @property
    def steps(self) -> list[int]:
        """Each column's first step."""
        return list(self._steps)

    def __len__(self) -> int:
        return len(self._cells)

    def add(self, step: int, values: Mapping[str, float]) -> None:
        """Adds one step's value of each layer."""
        if self._cells and self._filled == self._stride and len(self._cells) == self.columns:
            self._halve()
        if not self._cells or self._filled == self._stride:
            self._cells.append({})
            self._steps.append(step)
            self._filled = 0
        self._filled += 1
        for layer, value in values.items():
            self._layers.setdefault(layer, None)
            cell, value = self._cells[-1].setdefault(layer, [0.0, 0, False]), float(value)
            if not math.isfinite(value):
                cell[2] = True
            else:
                cell[0] += (math.log10(value) if value > 0 else -math.inf) if self.log else value
                cell[1] += 1

    def _halve(self) -> None:
        pairs = [self._cells[i:i + 2] for i in range(0, len(self._cells), 2)]
        self._cells = [{layer: [sum(c[layer][0] for c in pair if layer in c),
                                sum(c[layer][1] for c in pair if layer in c),
                                any(c[layer][2] for c in pair if layer in c)]
                        for layer in {**pair[0], **pair[-1]}} for pair in pairs]
        self._steps = self._steps[::2]
        self._filled, self._stride = self._stride * len(pairs[-1]), self._stride * 2

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values, missing)``, each ``[layers, columns]`` (NaN where a value was non-finite)."""
        values = np.full((len(self._layers), len(self._cells)), np.nan)
        missing = np.ones(values.shape, bool)
        for j, column in enumerate(self._cells):
            for i, layer in enumerate(self._layers):
                if (cell := column.get(layer)) is not None:
                    missing[i, j] = False
                    if not cell[2] and cell[1]:
                        mean = cell[0] / cell[1]
                        values[i, j] = 10.0 ** mean if self.log else mean
        return values, missing

    def figure(self, **options: Any) -> Figure:
        """The heatmap (:func:`heatmap_figure`), with the layers' names and each column's first step."""
        return self._later(heatmap_figure, options)()

    def drawing(self, **options: Any) -> Callable[[], bytes]:
        """The PNG of :meth:`figure` of the values as they are now, drawn when called (on any thread)."""
        return self._later(heatmap_png, options)

    def _later(self, draw: Callable[..., Any], options: dict[str, Any]) -> Callable[[], Any]:
        if not self._cells:
            raise ValueError("no step was added: there is nothing to draw")
        _need_matplotlib()  # said here, on the caller's thread, not where the drawing runs
        values, missing = self.arrays()
        options.setdefault("rows", self.layers)
        options.setdefault("steps", self.steps)
        return functools.partial(draw, values, log=self.log, missing=missing, **options)
