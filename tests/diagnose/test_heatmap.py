"""The heatmaps Diagnose draws, read back from matplotlib's figure: the cells'
values and masks, the colour scale, the labels, the colour bar, the PNG file."""

import io
import threading

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from matplotlib.colors import LogNorm, Normalize, to_rgba  # noqa: E402
from PIL import Image  # noqa: E402

from flaxhooks.diagnose import (  # noqa: E402
    DPI,
    MISSING,
    NON_FINITE,
    Heatmaps,
    heatmap_figure,
    heatmap_png,
)


class Drawn:
    """A heatmap's parts, once drawn: the cells' image, the non-finite cells'
    image over it, the axes and the colour bar's axes."""

    def __init__(self, figure):
        figure.canvas.draw()  # tick labels are set when drawn
        self.figure = figure
        self.axes, self.bar = figure.axes
        self.cells, self.nonfinite = self.axes.images

    def rows(self) -> list[str]:
        return [label.get_text() for label in self.axes.get_yticklabels()]

    def steps(self) -> list[str]:
        return [label.get_text() for label in self.axes.get_xticklabels()]

    def bar_labels(self) -> list[tuple[float, str]]:
        """The colour bar's tick labels shown within its ends, with their values."""
        low, high = sorted(self.bar.get_ylim())
        ticks = self.bar.yaxis.get_majorticklabels() + self.bar.yaxis.get_minorticklabels()
        return sorted((t.get_position()[1], t.get_text()) for t in ticks
                      if t.get_text() and low <= t.get_position()[1] <= high)

    def bar_colours(self) -> np.ndarray:
        """The distinct colours of the colour bar."""
        from matplotlib.collections import QuadMesh

        (mesh,) = [found for found in self.bar.collections if isinstance(found, QuadMesh)]
        return np.unique(mesh.to_rgba(mesh.get_array()).reshape(-1, 4), axis=0)

    def colours(self) -> np.ndarray:
        """Each cell's RGBA colour as the cells' image maps it (masked cells: its bad colour)."""
        return self.cells.to_rgba(self.cells.get_array())


def draw(values, **options) -> Drawn:
    return Drawn(heatmap_figure(np.asarray(values, np.float64), **options))


def luminance(rgba) -> np.ndarray:
    return np.asarray(rgba, np.float64)[..., :3] @ [0.2126, 0.7152, 0.0722]


def test_the_png_is_the_figure_at_a_fixed_resolution_that_grows_with_rows_and_columns():
    rng = np.random.default_rng(0)
    values = rng.lognormal(size=(4, 30))
    figure = heatmap_figure(values, rows=["a", "b", "c", "d"], steps=range(30), title="rms")
    png = Image.open(io.BytesIO(heatmap_png(values, rows=["a", "b", "c", "d"], steps=range(30), title="rms")))
    assert png.format == "PNG" and png.size == tuple(round(x * DPI) for x in figure.get_size_inches())
    small, tall, wide = (heatmap_figure(np.ones(shape)).get_size_inches() for shape in
                         ((2, 4), (30, 4), (2, 300)))
    assert tall[1] > small[1] and tall[0] == small[0]
    assert wide[0] > small[0] and wide[1] == small[1]
    huge = heatmap_figure(np.ones((500, 5000))).get_size_inches()
    assert huge[0] <= 14 and huge[1] <= 11  # bounded


def test_figures_drawn_on_several_threads_at_once_are_the_same_file():
    values = np.random.default_rng(1).lognormal(size=(6, 40))
    options = {"rows": [f"dense_{i}" for i in range(6)], "steps": range(40), "title": "gradient rms"}
    expected = heatmap_png(values, **options)
    found: list[bytes] = []
    threads = [threading.Thread(target=lambda: found.append(heatmap_png(values, **options)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == [expected] * 4


def test_larger_values_are_lighter_along_the_whole_map():
    drawn = draw(np.arange(1.0, 11.0)[None], log=False)
    along = luminance(drawn.cells.cmap(np.linspace(0.0, 1.0, 64)))
    assert drawn.cells.cmap.name.startswith("viridis")
    assert (np.diff(along) > 0).all() and along[-1] - along[0] > 0.6
    assert (np.diff(luminance(drawn.colours()[0])) > 0).all()


def test_a_log_scale_tells_decades_apart():
    drawn = draw([[1e-6, 1e-3, 1.0]])
    assert isinstance(drawn.cells.norm, LogNorm)
    np.testing.assert_allclose(drawn.cells.norm(drawn.cells.get_array())[0], [0.0, 0.5, 1.0])
    labels = dict(drawn.bar_labels())
    assert {1e-6, 1e-3, 1.0} <= set(labels) and "10^{-3}" in labels[1e-3]  # decades on the bar
    # On a linear scale 1e-6 and 1e-3 look the same.
    linear = draw([[1e-6, 1e-3, 1.0]], log=False)
    assert type(linear.cells.norm) is Normalize
    colours = linear.colours()[0]
    assert np.allclose(colours[0], colours[1], atol=0.01)


def test_a_log_scale_only_where_the_values_span_a_decade():
    assert type(draw([[2.0, 9.0]]).cells.norm) is Normalize
    assert isinstance(draw([[2.0, 20.0]]).cells.norm, LogNorm)


def test_zero_takes_the_lowest_colour_on_a_log_scale_and_fractions_read_linearly():
    drawn = draw([[0.0, 1e-4, 1e-2]])
    assert isinstance(drawn.cells.norm, LogNorm) and drawn.cells.norm.vmin == 1e-4
    np.testing.assert_allclose(drawn.colours()[0, :2], [drawn.cells.cmap(0.0)] * 2)
    fractions = draw([[0.0, 0.5, 1.0]], log=False, vmin=0, vmax=1)
    assert (fractions.cells.norm.vmin, fractions.cells.norm.vmax) == (0.0, 1.0)
    np.testing.assert_allclose(fractions.colours()[0], fractions.cells.cmap([0.0, 0.5, 1.0]))


def test_non_finite_and_missing_cells_have_colours_of_their_own():
    values = np.array([[1.0, np.nan, 3.0], [np.inf, 2.0, -np.inf]])
    missing = np.array([[False, False, True], [False, False, False]])
    drawn = draw(values, missing=missing)
    assert drawn.cells.get_array().mask.tolist() == [[False, True, True], [True, False, True]]
    assert (~drawn.nonfinite.get_array().mask).tolist() == [[False, True, False], [True, False, True]]
    assert drawn.cells.cmap.get_bad() == pytest.approx(to_rgba(MISSING))
    assert drawn.nonfinite.cmap(0.0) == pytest.approx(to_rgba(NON_FINITE))
    palette = drawn.cells.cmap(np.linspace(0, 1, 256))
    for special in (NON_FINITE, MISSING):
        assert np.abs(palette - to_rgba(special)).max(axis=1).min() > 0.1  # no cell's colour is near it
    (legend,) = drawn.figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["non-finite", "no value"]
    assert not draw([[1.0, 2.0]]).figure.legends  # nothing to explain


def test_many_steps_share_columns_and_a_non_finite_one_stays_visible():
    assert draw(np.ones((3, 300))).cells.get_array().shape == (3, 300)
    wide = np.ones((2, 5000))
    wide[1, 4000] = np.nan
    drawn = draw(wide, steps=range(10, 50010, 10), columns=500)
    assert drawn.cells.get_array().shape == (2, 500)
    assert np.flatnonzero(~drawn.nonfinite.get_array().mask[1]).tolist() == [400]
    # Each tick is its column's first step.
    steps = [int(s) for s in drawn.steps()]
    assert steps[0] == 10 and steps[-1] == 10 * (1 + 4990) and all(s % 100 == 10 for s in steps)
    # A column's value is its steps' geometric mean on a log scale.
    ramp = draw(10.0 ** np.arange(4.0)[None], columns=2)
    np.testing.assert_allclose(ramp.cells.get_array()[0], [10**0.5, 10**2.5])


def test_heatmaps_keep_the_whole_run_in_a_bounded_number_of_columns():
    maps = Heatmaps(columns=4)
    for step in range(1, 9):
        values = {"first": 10.0 ** -step}
        if step >= 3:  # a layer seen from step 3 on
            values["late"] = 1.0 if step != 6 else float("nan")
        maps.add(step, values)
    assert len(maps) == 4 and maps.steps == [1, 3, 5, 7] and maps.layers == ["first", "late"]
    values, missing = maps.arrays()
    np.testing.assert_allclose(values[0], [10.0 ** -1.5, 10.0 ** -3.5, 10.0 ** -5.5, 10.0 ** -7.5])
    assert missing.tolist() == [[False] * 4, [True, False, False, False]]
    assert np.isnan(values[1, 2]) and values[1, 3] == 1.0  # step 6 was not finite
    maps.add(9, {"first": 0.0})  # full: columns merge pairwise, each later one takes 4 steps
    assert maps.steps == [1, 5, 9]
    np.testing.assert_allclose(maps.arrays()[0][0, :2], [10.0 ** -2.5, 10.0 ** -6.5])
    assert maps.arrays()[0][0, 2] == 0.0
    drawn = Drawn(maps.figure(title="rms"))
    assert drawn.rows() == ["first", "late"] and drawn.steps() == ["1", "5", "9"]
    assert (~drawn.nonfinite.get_array().mask).tolist() == [[False] * 3, [False, True, False]]
    assert drawn.cells.get_array().mask[1].tolist() == [False, True, True]  # not at step 9


def test_heatmaps_on_a_linear_scale_take_the_mean():
    maps = Heatmaps(columns=2, log=False)
    for step, value in enumerate([0.0, 0.5, 1.0, 1.0], start=1):
        maps.add(step, {"dense": value})
    assert maps.steps == [1, 3] and maps.arrays()[0].tolist() == [[0.25, 1.0]]
    with pytest.raises(ValueError, match="nothing to draw"):
        Heatmaps().figure()


def test_names_keep_their_case_and_long_ones_keep_their_end():
    long = "encoder/layers_11/attention/query_projection"
    drawn = draw(np.ones((3, 4)), rows=["Conv_0", "Dense_1", long], steps=[1, 2, 3, 4], title="gradient rms")
    assert drawn.rows()[:2] == ["Conv_0", "Dense_1"] and drawn.axes.get_title() == "gradient rms"
    assert drawn.rows()[2].startswith("\u2026") and long.endswith(drawn.rows()[2][1:])
    assert drawn.steps() == ["1", "2", "3", "4"] and drawn.axes.get_xlabel() == "step"
    many = draw(np.ones((100, 2)), rows=[f"layer_{i}" for i in range(100)])
    assert 20 <= len(many.rows()) <= 40 and many.rows()[:2] == ["layer_0", "layer_3"]


@pytest.mark.parametrize(("low", "high"),
                         [(0.0023401, 0.0023449), (1.0, 1.0 + 2e-12), (-5e-7, 5e-7), (3e-3, 7.5)])
def test_the_colour_bar_spans_the_values_and_reads_along_them(low, high):
    drawn = draw([[low, high]], log=low > 0, steps=[1, 2])
    assert (drawn.cells.norm.vmin, drawn.cells.norm.vmax) == (low, high)
    assert isinstance(drawn.cells.norm, LogNorm) == (low > 0 and high / low >= 10)
    shown = drawn.bar_labels()
    # At least two ticks within the ends, none reading like another.
    assert len(shown) >= 2 and len({text for _, text in shown}) == len(shown)


def test_a_constant_range_says_so_and_its_bar_is_the_cells_colour():
    drawn = draw(np.full((2, 3), 0.0023401), steps=[1, 2, 3])
    assert drawn.bar.get_ylabel() == "every value is 0.00234"
    cell = drawn.colours()[0, 0]
    assert np.allclose(drawn.colours(), cell) and np.allclose(cell, drawn.cells.cmap(0.5))  # the middle
    np.testing.assert_allclose(drawn.bar_colours(), [cell])
    assert [text for _, text in drawn.bar_labels()] == ["0.00234"]
    # Otherwise the bar is the whole map, and says nothing of the sort.
    spread = draw([[1e-3, 1e-1]], steps=[1, 2])
    assert len(spread.bar_colours()) > 100 and spread.bar.get_ylabel() == ""


def test_only_a_range_every_value_shares_is_called_constant():
    # Zeros beside one positive value on a log scale: two colours, so a range with two ends.
    assert draw([[0.0, 0.5, 0.5]], steps=[1, 2, 3]).bar.get_ylabel() == ""
    # A range given as one value is not the values' own.
    assert draw([[0.2, 0.8]], log=False, vmin=0.5, vmax=0.5).bar.get_ylabel() == ""
    # Non-finite cells beside one finite value: said of the finite values.
    assert draw([[0.5, np.nan, 0.5]], log=False).bar.get_ylabel() == "every finite value is 0.5"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"values \[layers, steps\]"):
        heatmap_figure(np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match="3 row names for 2 rows"):
        heatmap_figure(np.ones((2, 2)), rows=["a", "b", "c"])
    with pytest.raises(ValueError, match="1 steps for 2 columns"):
        heatmap_figure(np.ones((2, 2)), steps=[1])
    with pytest.raises(ValueError, match="log scale starts above 0"):
        heatmap_figure(np.ones((2, 2)), vmin=0.0)
