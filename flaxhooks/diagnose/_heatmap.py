"""A statistic over layers and steps as a picture read at a glance: a heatmap
whose rows are the layers in depth order (the first at the top) and whose
columns are the steps, coloured on a perceptually ordered map (dark: low),
drawn as 8-bit RGB pixels without an imaging library."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

#: The colour map's anchors, evenly spaced from low to high: dark violet
#: through blue and green to yellow, each lighter than the one before.
_ANCHORS = np.array([
    (38, 12, 66), (64, 38, 112), (62, 72, 136), (48, 106, 142), (36, 136, 142),
    (40, 166, 128), (86, 192, 98), (160, 214, 62), (246, 230, 40)], np.float64)
#: A cell whose value is NaN or infinite.
NON_FINITE = (226, 36, 36)
#: A cell with no value (a layer not measured at that step).
MISSING = (200, 200, 200)
_BACKGROUND, _INK = (255, 255, 255), (40, 40, 40)

#: A 3-pixel-wide font, each glyph 6 rows: capitals and digits on the top 5,
#: lower case 4 rows high under an ascender row, descenders (g, j, p, q, y) on
#: the sixth. An entry is its character then its rows of 3 bits, top row first.
_GLYPHS = {entry[0]: np.array([bit == "1" for bit in entry[1:]]).reshape(6, 3) for entry in """
0111101101101111000 1010110010010111000 2111001111100111000 3111001011001111000 4101101111001001000
5111100111001111000 6111100111101111000 7111001010010010000 8111101111101111000 9111101111001111000
A010101111101101000 B110101110101110000 C011100100100011000 D110101101101110000 E111100110100111000
F111100110100100000 G011100101101011000 H101101111101101000 I111010010010111000 J001001001101010000
K101101110101101000 L100100100100111000 M101111111101101000 N110101101101101000 O010101101101010000
P110101110100100000 Q010101101110011000 R110101110101101000 S011100010001110000 T111010010010010000
U101101101101111000 V101101101101010000 W101101111111101000 X101101010101101000 Y101101010010010000
Z111001010100111000 .000000000000010000 -000000111000000000 +000010111010000000 _000000000000111000
/001001010100100000 :000010000010000000 (010100100100010000 )010001001001010000 ?111001010000010000
a000110011101111000 b100110101101110000 c000011100100011000 d001011101101011000 e000010101110011000
f001010111010010000 g000011101011001110 h100110101101101000 i010000010010010000 j001000001001101010
k100101110110101000 l110010010010111000 m000111111101101000 n000110101101101000 o000010101101010000
p000110101101110100 q000011101101011001 r000011100100100000 s000011110011110000 t010111010010011000
u000101101101011000 v000101101101010000 w000101101111111000 x000101010010101000 y000101101011001110
z000111011110111000 =000111000111000000 ,000000000000010100 '010010000000000000 %101001010100101000
""".split()}
#: Rows of a glyph, and the pixels from one character's left edge to the next's.
_GLYPH_ROWS, _PITCH = 6, 4


def colormap(t: np.ndarray) -> np.ndarray:
    """The colours (uint8 ``[..., 3]``) of positions ``t`` on the map, 0 (dark) to 1 (light).

    Examples:
        >>> colormap(np.array([0.0, 1.0])).tolist()
        [[38, 12, 66], [246, 230, 40]]
    """
    t = np.clip(np.asarray(t, np.float64), 0.0, 1.0)
    anchors = np.linspace(0.0, 1.0, len(_ANCHORS))
    channels = [np.interp(t, anchors, _ANCHORS[:, c]) for c in range(3)]
    return np.stack(channels, axis=-1).round().astype(np.uint8)


class _Range(NamedTuple):
    """The values of a colour bar's ends; ``constant``: every value drawn is
    ``low`` (the bar is spread around it, and the cells take its middle)."""

    low: float
    high: float
    constant: bool = False


def _scale(values: np.ndarray, missing: np.ndarray, log: bool, vmin: float | None,
           vmax: float | None) -> tuple[np.ndarray, np.ndarray, _Range]:
    """Each cell's position on the map, which cells are non-finite, and the range."""
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
    # Every finite value the same (on a log scale, none <= 0 besides): said under the bar.
    constant = bool(found.size and found.min() == found.max() == low == high and (usable == finite).all())
    if high == low:  # a range of one value: that value in the middle of the map
        value = low
        pad = max(abs(low), 1.0) / 2
        low, high = (low / 10**0.5, high * 10**0.5) if log else (low - pad, high + pad)
    if log:
        x, lo, hi = np.log10(np.where(usable, values, low)), math.log10(low), math.log10(high)
    else:
        x, lo, hi = np.where(finite, values, low), low, high
    scale = _Range(value, value, True) if constant else _Range(low, high)
    return np.clip((x - lo) / (hi - lo), 0.0, 1.0), ~missing & ~np.isfinite(values), scale


def _merge_columns(t: np.ndarray, bad: np.ndarray, missing: np.ndarray,
                   columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of neighbouring columns as one: the mean position of their values
    (a geometric mean on a log scale); non-finite if any is, missing if all are."""
    starts = np.linspace(0, t.shape[1], columns + 1).round().astype(int)[:-1]
    ok = ~(bad | missing)
    sums = np.add.reduceat(np.where(ok, t, 0.0), starts, axis=1)
    counts = np.add.reduceat(ok.astype(np.int64), starts, axis=1)
    return (sums / np.maximum(counts, 1), np.logical_or.reduceat(bad, starts, axis=1),
            np.logical_and.reduceat(missing, starts, axis=1))


def heatmap(values: np.ndarray, *, log: bool = True, vmin: float | None = None, vmax: float | None = None,
            missing: np.ndarray | None = None, rows: Sequence[str] | None = None,
            steps: Sequence[int] | None = None, title: str | None = None,
            cell: tuple[int, int] = (12, 8), width: int = 1024, decorate: bool = True) -> np.ndarray:
    """The picture (uint8 ``[H, W, 3]``) of ``values[layer, step]``: one row
    per layer (the first at the top), one column per step, dark for low values.

    Args:
        values: ``[layers, steps]``; NaN and infinities are drawn in red (:data:`NON_FINITE`).
        log: colour by ``log10(value)`` (values <= 0 take the lowest colour);
            fractions read better on a linear scale (``log=False, vmin=0, vmax=1``).
        vmin, vmax: the values of the lowest and highest colours (default: the
            smallest and largest finite values; positive ones on a log scale).
        missing: ``[layers, steps]``, True where a layer has no value (drawn grey, :data:`MISSING`).
        rows: the layers' names, written left of their rows (when a row is at least 6 pixels tall).
        steps: the columns' steps: the first and last are written under the picture.
        title: written above the picture.
        cell: ``(height, width)`` of a cell in pixels. Where the steps would
            make the picture wider than ``width`` pixels, columns get narrower
            (to 1 pixel), then neighbouring steps share a column (their mean;
            non-finite if any is).
        decorate: with the margins, names and colour bar (its range written
            under it, and whether it is a log scale: :func:`bar_labels`);
            False draws the cells alone, ``[layers * cell[0],
            columns * cell[1], 3]``.

    Examples:
        >>> heatmap(np.array([[1e-3, 1e-2, 1e-1], [1.0, np.nan, 1.0]]), decorate=False).shape
        (24, 24, 3)
    """
    values = np.asarray(values, np.float64)
    values = values[None] if values.ndim == 1 else values
    if values.ndim != 2 or not values.size:
        raise ValueError(f"a heatmap needs values [layers, steps], not an array of shape {values.shape}")
    missing = np.broadcast_to(np.asarray(False if missing is None else missing, bool), values.shape)
    t, bad, scale = _scale(values, missing, log, vmin, vmax)
    cell_h, cell_w = max(1, cell[0]), max(1, min(cell[1], width // values.shape[1]))
    columns = min(values.shape[1], max(1, width // cell_w))
    if columns < values.shape[1]:
        t, bad, missing = _merge_columns(t, bad, missing, columns)
    colours = colormap(t)
    colours[bad], colours[missing] = NON_FINITE, MISSING
    grid = np.repeat(np.repeat(colours, cell_h, axis=0), cell_w, axis=1)
    if not decorate:
        return grid
    names = [] if rows is None or cell_h < _GLYPH_ROWS else [_short(str(name)) for name in rows]
    labels = bar_labels(scale, log, nonfinite=bool(bad.any()))
    return _decorate(grid, names, cell_h, steps, title, labels, scale.constant)


def _short(name: str, length: int = 20) -> str:
    return name if len(name) <= length else ".." + name[-(length - 2):]


def _text_width(text: str, scale: int) -> int:
    return max(0, _PITCH * len(text) - 1) * scale


def glyph(char: str) -> np.ndarray:
    """The pixels (bool ``[6, 3]``) a character is written with, as it is
    (``"o"`` is not ``"O"``); one the font lacks is written as ``?``."""
    return _GLYPHS.get(char, _GLYPHS["?"])


def _text(canvas: np.ndarray, y: int, x: int, text: str, scale: int) -> None:
    """Writes ``text`` with its top left corner at ``(y, x)``."""
    for i, char in enumerate(text):
        if char != " ":
            pixels = np.kron(glyph(char), np.ones((scale, scale), bool))
            left = x + _PITCH * scale * i
            canvas[y:y + _GLYPH_ROWS * scale, left:left + 3 * scale][pixels] = _INK


def range_labels(low: float, high: float, digits: int = 3) -> tuple[str, str]:
    """The labels of a colour bar's ends: ``digits`` significant digits, or
    as many more as it takes for different values to read differently.

    Examples:
        >>> range_labels(0.002341, 0.002344)
        ('0.002341', '0.002344')
        >>> range_labels(1e-5, 0.25)
        ('1e-05', '0.25')
    """
    for shown in range(digits, 18):
        labels = (f"{low:.{shown}g}", f"{high:.{shown}g}")
        if labels[0] != labels[1] or low == high:
            return labels
    return labels


def bar_labels(scale: _Range, log: bool, nonfinite: bool = False) -> tuple[str, str, str]:
    """What is written under the colour bar: its low end, its middle and its
    high end. A constant range says so instead of a spread no value has
    (``nonfinite``: of the finite values, some cells being NaN or infinite).

    Examples:
        >>> bar_labels(_Range(0.001, 0.1), log=True)
        ('0.001', 'log scale', '0.1')
        >>> bar_labels(_Range(0.5, 0.5, constant=True), log=False)
        ('every value is 0.5', '', '')
    """
    if scale.constant:
        return f"every {'finite ' * nonfinite}value is {range_labels(scale.low, scale.high)[0]}", "", ""
    low, high = range_labels(scale.low, scale.high)
    return low, "log scale" if log else "", high


def _decorate(grid: np.ndarray, names: Sequence[str], cell_h: int, steps: Sequence[int] | None,
              title: str | None, labels: tuple[str, str, str], constant: bool) -> np.ndarray:
    """The cells with a margin, the rows' names, the steps, the title and a
    colour bar with its labels (low end, middle, high end); ``constant``:
    every cell has the bar's middle colour."""
    scale = 2 if cell_h >= 2 * _GLYPH_ROWS else 1
    margin, line = _PITCH * scale, _GLYPH_ROWS * scale
    grid_h, grid_w = grid.shape[:2]
    names_w = max([_text_width(n, scale) + margin for n in names], default=0)
    ends = ("", "")
    if steps is not None and len(steps):
        ends = (f"step {int(steps[0])}", str(int(steps[-1])) if int(steps[-1]) != int(steps[0]) else "")
    bar_w, bar_h = max(min(grid_w, 256), 64), 2 * line  # the bar's least width
    steps_w = max(grid_w, _text_width(" ".join(ends), scale) + margin)
    labels_w = max(bar_w, _text_width("  ".join(label for label in labels if label), scale) + margin)
    # From the top: the title, the cells, the steps, the colour bar and its range.
    grid_y = margin + (line + margin if title else 0)
    steps_y = grid_y + grid_h + margin
    bar_y = steps_y + (line + margin if steps is not None else 0)
    height = bar_y + bar_h + scale + line + margin
    width = 2 * margin + names_w + max(steps_w, labels_w, _text_width(title or "", scale))
    canvas = np.empty((height, width, 3), np.uint8)
    canvas[:] = _BACKGROUND
    left = margin + names_w
    canvas[grid_y:grid_y + grid_h, left:left + grid_w] = grid
    if title:
        _text(canvas, margin, left, title, scale)
    for i, name in enumerate(names):
        _text(canvas, grid_y + i * cell_h + (cell_h - line) // 2, margin, name, scale)
    if steps is not None:
        _text(canvas, steps_y, left, ends[0], scale)
        _text(canvas, steps_y, left + steps_w - _text_width(ends[1], scale), ends[1], scale)
    # The bar spans its labels; a constant range is all the one colour its cells have.
    bar = np.full(labels_w, 0.5) if constant else np.linspace(0.0, 1.0, labels_w)
    canvas[bar_y:bar_y + bar_h, left:left + labels_w] = colormap(bar)[None]
    labels_y = bar_y + bar_h + scale
    _text(canvas, labels_y, left, labels[0], scale)
    last = left + labels_w - _text_width(labels[2], scale)
    # The middle label centred, but never on an end's (they are two spaces apart at the least).
    gap = 2 * _PITCH * scale
    middle_w = _text_width(labels[1], scale)
    centred = left + (labels_w - middle_w) // 2
    middle = min(max(centred, left + _text_width(labels[0], scale) + gap), last - gap - middle_w)
    _text(canvas, labels_y, middle, labels[1], scale)
    _text(canvas, labels_y, last, labels[2], scale)
    return canvas


class Heatmaps:
    """The history of one statistic per layer, as a heatmap of bounded width:
    once it holds ``columns`` columns, neighbouring columns merge pairwise and
    each later column gathers twice as many steps, so the whole run fits.

    Layers are rows in the order they first appear (pass them in depth
    order); a layer that has no value at a step leaves a grey cell there.

    Args:
        columns: the most columns kept (at least 2).
        log: whether values are compared on a log scale: merged steps take
            the geometric mean (else the mean), and the picture is coloured by
            ``log10``. A non-finite value marks its column's cell non-finite.

    Examples:
        >>> maps = Heatmaps(columns=4)
        >>> for step in range(1, 11):
        ...     maps.add(step, {"dense_0": 1.0, "dense_1": 10.0 ** -step})
        >>> maps.steps, maps.layers
        ([1, 5, 9], ['dense_0', 'dense_1'])
        >>> maps.image(decorate=False).shape
        (24, 24, 3)
    """

    def __init__(self, columns: int = 256, *, log: bool = True):
        if columns < 2:
            raise ValueError(f"a heatmap keeps at least 2 columns, not {columns}")
        self.columns, self.log = columns, log
        self._layers: dict[str, None] = {}  # in the order first seen
        self._steps: list[int] = []  # each column's first step
        self._cells: list[dict[str, list[Any]]] = []  # per column: {layer: [sum, count, non-finite]}
        self._stride, self._filled, self._last = 1, 0, 0  # steps a full column gathers; the last one's

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
        """Adds one step's value of each layer (host floats)."""
        if self._cells and self._filled == self._stride and len(self._cells) == self.columns:
            self._halve()
        if not self._cells or self._filled == self._stride:
            self._cells.append({})
            self._steps.append(step)
            self._filled = 0
        self._filled, self._last = self._filled + 1, step
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
        """``(values, missing)``, each ``[layers, columns]``: a column's mean
        (geometric on a log scale; NaN if any value was non-finite), and
        whether a layer had no value there."""
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

    def image(self, **options: Any) -> np.ndarray:
        """The picture (:func:`heatmap`, with the layers' names and the steps;
        ``options`` are its keyword arguments)."""
        return self.drawing(**options)()

    def drawing(self, **options: Any) -> Callable[[], np.ndarray]:
        """:meth:`image` of the values as they are now, drawn when called
        (on another thread: adding values meanwhile changes nothing of it)."""
        if not self._cells:
            raise ValueError("no step was added: there is nothing to draw")
        values, missing = self.arrays()
        options.setdefault("rows", self.layers)
        options.setdefault("steps", (self._steps[0], self._last))
        return functools.partial(heatmap, values, log=self.log, missing=missing, **options)
