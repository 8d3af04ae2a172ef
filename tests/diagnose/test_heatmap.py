"""The heatmaps Diagnose draws: pixels, colours, sizes, and their PNG files."""

import struct
import zlib

import numpy as np
import pytest

from flaxhooks.diagnose import (
    MISSING,
    NON_FINITE,
    Heatmaps,
    colormap,
    encode_png,
    glyph,
    heatmap,
    range_labels,
)


def decode_png(png: bytes) -> np.ndarray:
    """The pixels of an 8-bit RGB PNG whose rows are unfiltered (what encode_png writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(png):
        (length,) = struct.unpack_from(">I", png, offset)
        kind, data = png[offset + 4:offset + 8], png[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack_from(">I", png, offset + 8 + length)
        assert crc == zlib.crc32(kind + data), kind
        chunks[kind] = chunks.get(kind, b"") + data
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, interlace) == (8, 2, 0) and b"IEND" in chunks
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()  # filter type 0: the bytes as they are
    return rows[:, 1:].reshape(height, width, 3)


def luminance(rgb) -> np.ndarray:
    return np.asarray(rgb, np.float64) @ [0.2126, 0.7152, 0.0722]


def cells(image: np.ndarray, cell=(12, 8)) -> np.ndarray:
    """The colour of each cell of a picture drawn without decoration."""
    return image[::cell[0], ::cell[1]]


def test_the_png_decodes_to_the_same_pixels():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(encode_png(noise)), noise)
    picture = heatmap(rng.lognormal(size=(4, 30)), rows=["a", "b", "c", "d"], steps=range(30), title="rms")
    assert np.array_equal(decode_png(encode_png(picture)), picture)


def test_encode_png_refuses_what_is_not_8_bit_pixels():
    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="empty"):
        encode_png(np.zeros((0, 2, 3), np.uint8))


def test_larger_values_are_lighter_along_the_whole_map():
    along = luminance(colormap(np.linspace(0.0, 1.0, 64)))
    assert (np.diff(along) > 0).all() and along[-1] - along[0] > 150
    ramp = cells(heatmap(np.arange(1.0, 11.0)[None], log=False, decorate=False))[0]
    assert (np.diff(luminance(ramp)) > 0).all()


def test_a_log_scale_tells_decades_apart():
    low, middle, high = cells(heatmap(np.array([[1e-6, 1e-3, 1.0]]), decorate=False))[0].astype(int)
    assert np.array_equal(middle, colormap(0.5))  # 1e-3 is halfway between 1e-6 and 1 in log10
    for a, b in ((low, middle), (middle, high), (low, high)):
        assert np.linalg.norm(a - b) > 60
    # On a linear scale 1e-6 and 1e-3 look the same.
    linear = cells(heatmap(np.array([[1e-6, 1e-3, 1.0]]), log=False, decorate=False))[0]
    assert np.array_equal(linear[0], linear[1])


def test_zero_takes_the_lowest_colour_on_a_log_scale_and_fractions_read_linearly():
    drawn = cells(heatmap(np.array([[0.0, 1e-4, 1e-2]]), decorate=False))[0]
    assert np.array_equal(drawn[0], colormap(0.0)) and np.array_equal(drawn[1], colormap(0.0))
    fractions = cells(heatmap(np.array([[0.0, 0.5, 1.0]]), log=False, vmin=0, vmax=1, decorate=False))[0]
    assert np.array_equal(fractions, colormap(np.array([0.0, 0.5, 1.0])))


def test_non_finite_and_missing_cells_have_colours_of_their_own():
    values = np.array([[1.0, np.nan, 3.0], [np.inf, 2.0, -np.inf]])
    missing = np.array([[False, False, True], [False, False, False]])
    drawn = cells(heatmap(values, missing=missing, decorate=False))
    assert [tuple(drawn[0, 1]), tuple(drawn[1, 0]), tuple(drawn[1, 2])] == [NON_FINITE] * 3
    assert tuple(drawn[0, 2]) == MISSING
    finite_colours = {tuple(c) for c in colormap(np.linspace(0, 1, 256))}
    assert NON_FINITE not in finite_colours and MISSING not in finite_colours


def test_each_cell_is_a_block_and_many_steps_fit_the_width():
    assert heatmap(np.ones((3, 10)), decorate=False).shape == (36, 80, 3)
    assert heatmap(np.ones((3, 10)), cell=(8, 4), decorate=False).shape == (24, 40, 3)
    assert heatmap(np.ones((5, 300)), decorate=False).shape == (60, 300 * 3, 3)  # narrower columns
    wide = np.ones((2, 5000))
    wide[1, 4000] = np.nan  # a non-finite step stays visible in the column it shares
    drawn = heatmap(wide, width=1024, decorate=False)
    assert drawn.shape == (24, 1024, 3)
    assert [tuple(c) for c in cells(drawn, (12, 1))[1] if tuple(c) == NON_FINITE] == [NON_FINITE]
    decorated = heatmap(np.ones((3, 10)), rows=["dense_0", "dense_1", "head"], steps=range(10), title="x")
    assert decorated.dtype == np.uint8 and decorated.shape[0] > 36 and decorated.shape[1] > 80


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
    drawn = cells(maps.image(decorate=False), (12, 8))
    assert tuple(drawn[1, 1]) == NON_FINITE and tuple(drawn[1, 2]) == MISSING  # not at step 9


def test_heatmaps_on_a_linear_scale_take_the_mean():
    maps = Heatmaps(columns=2, log=False)
    for step, value in enumerate([0.0, 0.5, 1.0, 1.0], start=1):
        maps.add(step, {"dense": value})
    assert maps.steps == [1, 3] and maps.arrays()[0].tolist() == [[0.25, 1.0]]


# -- what is written on the picture -----------------------------------------

INK = (40, 40, 40)  # the colour text is written in: no cell, bar or margin has it


def written(text: str, scale: int) -> np.ndarray:
    """The ink of ``text`` (bool pixels) as the font draws it: glyphs 6 rows high, 4 pixels apart."""
    pixels = np.zeros((6 * scale, max(4 * len(text) - 1, 1) * scale), bool)
    for i, char in enumerate(text):
        if char != " ":
            left = 4 * scale * i
            pixels[:, left:left + 3 * scale] = np.kron(glyph(char), np.ones((scale, scale), bool))
    return pixels


def shows(picture: np.ndarray, text: str, scale: int = 2) -> bool:
    """Whether ``text`` is written somewhere on ``picture``, pixel for pixel (blank where it is blank)."""
    ink = (picture == INK).all(axis=-1)
    template = written(text, scale)
    first = np.argwhere(template)[0]  # its first inked pixel, row-major
    h, w = template.shape
    for y, x in np.argwhere(ink) - first:
        inside = 0 <= y <= ink.shape[0] - h and 0 <= x <= ink.shape[1] - w
        if inside and (ink[y:y + h, x:x + w] == template).all():
            return True
    return False


def test_the_font_has_lower_case_and_names_keep_their_case():
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    characters = letters + [c.upper() for c in letters] + list("0123456789_./-")
    drawn = {char: glyph(char).tobytes() for char in characters}
    assert len(set(drawn.values())) == len(drawn)  # every character its own glyph
    assert glyph("\u00e9").tobytes() == glyph("?").tobytes()  # one the font lacks reads as "?"
    picture = heatmap(np.ones((2, 4)), rows=["Conv_0", "Dense_1"], steps=[1, 4], title="gradient rms")
    for text in ("Conv_0", "Dense_1", "gradient rms", "step 1"):
        assert shows(picture, text), text
    assert not shows(picture, "CONV_0") and not shows(picture, "GRADIENT RMS")


@pytest.mark.parametrize(("low", "high"),
                         [(0.0023401, 0.0023449), (1.0, 1.0 + 2e-12), (-5e-7, 5e-7), (3e-3, 7.5)])
def test_different_ends_of_the_colour_bar_read_differently(low, high):
    picture = heatmap(np.array([[low, high]]), log=low > 0, steps=[1, 2])
    first, last = range_labels(low, high)
    assert float(first) < float(last)
    # Each label is its end's value, to within half the range: neither could be read as the other.
    assert abs(float(first) - low) < (high - low) / 2 and abs(float(last) - high) < (high - low) / 2
    for label in (first, last):
        assert shows(picture, label, scale=2), label
    assert shows(picture, "log scale", scale=2) == (low > 0)


def test_a_constant_range_says_so_and_its_bar_is_the_cells_colour():
    picture = heatmap(np.full((2, 3), 0.0023401), steps=[1, 3])
    assert shows(picture, "every value is 0.00234", scale=2)
    cells_colour = tuple(colormap(0.5))
    assert tuple(heatmap(np.full((2, 3), 0.0023401), decorate=False)[0, 0]) == cells_colour
    # The bar (the wide band of one colour under the cells) has that colour, not the map's spread.
    rows = [row for row in picture if (row == cells_colour).all(axis=-1).sum() >= 64]
    assert rows and not any((row == tuple(colormap(0.0))).all(axis=-1).any() for row in picture)
    # A log scale says so; a linear one does not.
    assert shows(heatmap(np.array([[1e-3, 1e-1]]), steps=[1, 2]), "log scale")
    assert not shows(heatmap(np.array([[0.0, 1.0]]), log=False, steps=[1, 2]), "log scale")


def test_only_a_range_every_value_shares_is_called_constant():
    # Zeros beside one positive value on a log scale: two colours, so a range with two ends.
    zeros = heatmap(np.array([[0.0, 0.5, 0.5]]), steps=[1, 3])
    assert not shows(zeros, "every value is 0.5") and shows(zeros, "log scale")
    # A range given as one value is not the values' own.
    given = heatmap(np.array([[0.2, 0.8]]), log=False, vmin=0.5, vmax=0.5, steps=[1, 2])
    assert not shows(given, "every value is 0.5")
    # Non-finite cells beside one finite value: said of the finite values.
    with_nan = heatmap(np.array([[0.5, np.nan, 0.5]]), log=False, steps=[1, 3])
    assert shows(with_nan, "every finite value is 0.5")
