"""Diagnose's findings and pictures as the real TensorBoard shows them, read
through its HTTP API with its default reader (the Rust data server, which
keeps one text entry per step and drops later steps when an earlier one
comes after them): two findings at one step are both visible, and Time
Series opens on the metrics, the loss among the groups it expands.

One healthy 20-step fit and one run of findings are written, then served by
one ``tensorboard`` subprocess (a hard timeout; always stopped)."""

from __future__ import annotations

import json
import re
import time
import types
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import optax
import pytest

pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
pytest.importorskip("tensorboard_data_server", reason="TensorBoard's default reader is not installed")

import flaxhooks  # noqa: E402
from benchmarks.screenshot_tensorboard import tensorboard  # noqa: E402
from flaxhooks import Finding  # noqa: E402
from flaxhooks.writers import TensorBoardWriter  # noqa: E402
from recipes.models import cross_entropy_loss  # noqa: E402  (loss and accuracy, as the recipe)
from tests.callbacks.test_diagnose import data  # noqa: E402
from tests.callbacks.test_diagnose_tensorboard import Healthy  # noqa: E402

pytestmark = pytest.mark.slow  # a real TensorBoard server

READ_TIMEOUT_S = 60
FINDINGS = "health/findings/text_summary"  # tensorboardX adds /text_summary
DEAD = Finding("dead_units", 200, "Dense_0", "41% of its units never fired", "a lower learning rate")
VANISHING = Finding("vanishing_gradients", 200, None, "gradients 1e-9 at the first layer", "residuals")
SPIKE = Finding("loss_spike", 205, None, "the loss rose 30 times", "clip gradients")


def _get(url: str, path: str, **query: str) -> Any:
    suffix = "?" + urllib.parse.urlencode(query) if query else ""
    with urllib.request.urlopen(url + path + suffix, timeout=15) as response:
        return json.load(response)


def _until(read, done) -> Any:
    """``read()`` once ``done`` says it is complete (the Rust reader loads in the background)."""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while not done(found := read()):
        if time.monotonic() > deadline:
            pytest.fail(f"TensorBoard did not show it within {READ_TIMEOUT_S} s: {found}")
        time.sleep(0.5)
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("runs")
    callbacks = [flaxhooks.TensorBoard(root / "healthy", every=5),
                 flaxhooks.Diagnose(every=1, window=10, table=False)]
    trainer = flaxhooks.Trainer(Healthy(), optax.adam(1e-2), cross_entropy_loss, callbacks=callbacks)
    trainer.fit(data(), steps=20)
    # Findings said as a fit says them: a loss spike read before the window ending at step 200
    # was judged, then two findings of that window.
    writer = TensorBoardWriter(root / "findings")
    loop = types.SimpleNamespace(writers=writer, emit=lambda event, payload: None)
    diagnose = flaxhooks.Diagnose(table=False)
    diagnose.update(loop, [SPIKE], 205)
    diagnose.update(loop, [VANISHING, DEAD], 200)
    writer.close()
    with tensorboard(root, tmp_path_factory.mktemp("server") / "tensorboard.log", fast=True) as url:
        yield url


def test_two_findings_at_one_step_are_both_visible(served: str) -> None:
    entries = _until(lambda: _get(served, "data/plugin/text/text", run="findings", tag=FINDINGS),
                     lambda found: bool(found))
    shown = " ".join(entry["text"] for entry in entries)
    for finding in (DEAD, VANISHING, SPIKE):
        assert finding.evidence in shown, (finding.kind, entries)
    (entry,) = entries  # one entry, at the latest step, the worst first
    assert entry["step"] == 205
    assert shown.index("dead_units") < shown.index("vanishing_gradients") < shown.index("loss_spike")


def _natural(tag: str) -> list[tuple[int, Any]]:
    """TensorBoard's order of tags (2.21's frontend, ``Qy`` in index.js): runs
    of digits by value, ``/`` and digits before other characters."""
    return [(0, float(part)) if part[0].isdigit() else (0, -1.0) if part == "/" else (1, part)
            for part in re.findall(r"\d+(?:\.\d+)?|/|[^\d/]", tag)]


def test_time_series_opens_on_the_metrics_with_the_loss_expanded(served: str) -> None:
    def tags() -> set[str]:
        found: set[str] = set()
        for plugin in ("scalars", "histograms", "images"):
            for run, run_tags in _get(served, f"data/plugin/{plugin}/tags").items():
                if run == "healthy" or run.startswith("healthy/"):
                    found |= set(run_tags)
        return found

    found = _until(tags, lambda found: "loss" in found and any(t.startswith("stats/heatmaps") for t in found))
    # Time Series groups the cards by the tag's text before the first "/", in tag order,
    # and expands the first two groups (index.js: zD, tagGroupExpanded).
    groups = list(dict.fromkeys(tag.split("/", 1)[0] for tag in sorted(found, key=_natural)))
    assert groups[:2] == ["accuracy", "loss"], groups
    assert "health" not in groups  # a healthy run charts no counter
    assert {t for t in found if "heatmaps" in t} == {
        f"stats/heatmaps/{name}" for name in ("dead_units", "gradient_rms", "update_ratio")}
