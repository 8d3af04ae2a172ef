"""Diagnose's in-step sums: against a float64 numpy reference, and the same on
one device as with the batch sharded over eight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxhooks
from flaxhooks.diagnose import (
    COLUMNS,
    MAX_ENTRIES,
    MAX_PARAM_SAMPLES,
    MAX_ROWS,
    MIN_ROWS,
    SLOPE_BINS,
    WINDOW_ENTRIES,
    chosen_rows,
    rows_read,
    step_entries,
    step_window,
)

# A Transformer's (examples, positions, units), a convolution's, a wide and a narrow dense layer's.
SHAPES = [(16, 11, 128), (16, 11, 512), (8, 14, 14, 32), (256, 4096), (40, 24), (24, 7, 3)]


def reference_row(z: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, ...]:
    """One layer's ``(row, reached, fired, mass)`` over the rows given, in float64, written out plainly."""
    z, g = z.astype(np.float64), g.astype(np.float64)
    abs_z, abs_g = np.abs(z), np.abs(g)
    edges = (0.0, *SLOPE_BINS, np.inf)
    bins = [(abs_z >= lo) & (abs_z < hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    values = {"count": z.size, "sum_z": z.sum(), "sum_z2": (z * z).sum(), "sum_g2": (g * g).sum(),
              "nonpositive": (z <= 0).sum(), "nonpositive_with_gradient": ((z <= 0) & (abs_g > 0)).sum()}
    for i, inside in enumerate(bins):
        values[f"bin{i}_count"] = inside.sum()
        values[f"bin{i}_abs_g"] = abs_g[inside].sum()
    row = np.array([values[c] for c in COLUMNS])
    return row, (abs_g > 0).any(0), (z > 0).any(0), np.maximum(z, 0).sum(0)


def layers(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    pairs = []
    for shape in SHAPES:
        z = (rng.normal(size=shape) * 3).astype(np.float32)
        g = (rng.normal(size=shape) * (rng.random(shape) > 0.4)).astype(np.float32)
        z[..., 0] = -np.abs(z[..., 0])  # a unit never positive ...
        g[..., 1] = 0.0  # ... and one that gets no gradient
        pairs.append((z, g))
    return pairs


def test_the_rows_read_stay_within_the_budget_and_cover_every_example_and_position():
    for examples, positions, units in [(64, 11, 128), (64, 11, 512), (64, 784, 32), (4096, 1, 256),
                                       (100, 1, 4096), (8, 3, 16), (1024, 16, 64)]:
        rows = chosen_rows(examples, positions, units)
        budget = rows_read(examples * positions, units)
        assert len(rows) == len(np.unique(rows)), "a row read twice"
        assert budget <= len(rows) < 2 * budget or len(rows) == examples
        assert min(MIN_ROWS, examples * positions) <= budget <= MAX_ROWS
        assert budget * units <= max(MAX_ENTRIES, MIN_ROWS * units)
        seen_examples, seen_positions = np.unique(rows // positions), np.unique(rows % positions)
        if examples <= budget:
            assert len(seen_examples) == examples, "an example never read"
        assert len(seen_positions) == min(positions, len(rows)), "a position never read"
        # As many from each of any power of two of groups of the examples, up to 64, that divides them.
        for groups in (2, 4, 8, 64):
            if examples % groups == 0:
                counts = np.bincount(rows // (examples * positions // groups), minlength=groups)
                assert len(set(counts)) == 1, (examples, positions, units, groups, counts)


def test_a_steps_sums_equal_a_float64_reference_over_the_rows_read():
    pairs = layers()
    ratio = jnp.array([0.5, 0.0])
    window = step_window([(jnp.asarray(z), jnp.asarray(g)) for z, g in pairs], ratio)
    start = 0
    for (z, g), got_row in zip(pairs, np.asarray(window.layers), strict=True):
        units = z.shape[-1]
        examples, positions = z.shape[0], int(np.prod(z.shape[1:-1]))
        rows = chosen_rows(examples, positions, units)
        flat_z, flat_g = z.reshape(-1, units)[rows], g.reshape(-1, units)[rows]
        row, reached, fired, mass = reference_row(flat_z, flat_g)
        np.testing.assert_allclose(got_row, row, rtol=2e-5, atol=1e-3)
        part = slice(start, start + units)
        np.testing.assert_array_equal(np.asarray(window.reached)[part], reached.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(window.fired)[part], fired.astype(np.float32))
        np.testing.assert_allclose(np.asarray(window.mass)[part], mass, rtol=2e-5, atol=1e-3)
        assert not fired[0] and not reached[1]
        start += units
    assert rows_read(16 * 11, 512) < 16 * 11, "a layer large enough to be sampled is among them"
    np.testing.assert_array_equal(np.asarray(window.params), [[0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])


def test_a_batch_sharded_over_eight_devices_gives_one_devices_sums():
    if jax.local_device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = Mesh(np.array(jax.local_devices()[:8]), ("data",))
    pairs = layers(seed=1)[:-1]  # the examples of each divide over 8 devices
    ratio = jnp.ones(3)

    def packed(values):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return step_window(values, ratio).pack()

    # One device, no mesh: each layer summed in one group.
    one = np.asarray(jax.jit(lambda values: step_window(values, ratio).pack())(
        [(jnp.asarray(z), jnp.asarray(g)) for z, g in pairs]))
    sharded = [tuple(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in pair) for pair in pairs]
    step = jax.jit(packed)
    text = step.lower(sharded).compile().as_text()
    # The devices add up their sums once for every layer, not once per layer and sum.
    assert text.count("all-reduce(") + text.count("all-gather(") == 1
    np.testing.assert_allclose(np.asarray(step(sharded)), one, rtol=1e-5, atol=1e-3)


def test_the_docs_state_the_budget_the_code_keeps():
    import pathlib
    import re

    page = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "diagnose.md"
    text = " ".join(page.read_text().split())
    stated = re.search(r"a big layer is read at ([\d,]+) of its entries a step \(([\d,]+) rows at least, "
                       r"([\d,]+) at most\)", text)
    assert stated, "the docs' sentence on the rows Diagnose reads"
    assert [int(n.replace(",", "")) for n in stated.groups()] == [MAX_ENTRIES, MIN_ROWS, MAX_ROWS]
    spread = re.search(r"a window that samples more than (\d+) steps reads ([\d,]+) of them spread over its "
                       r"steps \(every step of a (\d+)-step window: ([\d,]+) a step\)", text)
    assert spread, "the docs' sentence on a window's budget"
    more_than, window_entries, window, per_step = (int(n.replace(",", "")) for n in spread.groups())
    assert window_entries == WINDOW_ENTRIES and more_than == WINDOW_ENTRIES // MAX_ENTRIES
    assert step_entries(more_than) == MAX_ENTRIES > step_entries(more_than + 1)
    assert per_step == step_entries(window) and window == flaxhooks.Diagnose().window
    assert "A parameter leaf is read at 1,024 evenly spaced entries" in text
    assert MAX_PARAM_SAMPLES == 1024
