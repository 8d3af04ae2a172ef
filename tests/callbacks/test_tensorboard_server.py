"""What a person opening TensorBoard on a recipe run sees, read through the real server's HTTP API.

One short MNIST recipe run (one epoch of the bundled sample, about 31 steps)
is written once per module, served by the ``tensorboard`` package's own
server, and each test reads one part of what its dashboards show: the runs,
the tags the train and eval runs share, the Custom Scalars layout, the
HParams table and how many tags the default pages list. The HParams table is
also read with TensorBoard opened on the run's parent directory, as when
several runs are compared.

The recipe runs in a subprocess (two fake CPU devices, like a small laptop)
and the server is a subprocess too; both have hard timeouts, and the server
is always stopped, so this module cannot hang a CI job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard",
                    reason="the tensorboard package (pip install tensorboard) is not installed")

from benchmarks.screenshot_tensorboard import tensorboard  # noqa: E402  (the same server the screenshots use)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a recipe run and a real TensorBoard server

#: The evaluation's sub-run: the recipe names its evaluation ``eval``.
EVAL_RUN = "eval"
#: The HParams metric (group, tag) of each final eval metric: the latest
#: evaluation, written in the session's own run (TensorBoard joins the session
#: "." and a group "eval" into the run "./eval", which it cannot find).
RESULTS = {"loss": ("", f"results/{EVAL_RUN}/loss"), "accuracy": ("", f"results/{EVAL_RUN}/accuracy")}
#: The recipe's hyperparameters that the HParams table must show.
HPARAMS = {"learning_rate": 0.1, "batch_size": 128, "epochs": 1}
#: The hyperparameter that holds the model's parameter count.
PARAMETER_COUNT_HPARAM = "parameters"
#: Custom Scalars categories of per-layer statistics, with the tag prefix of each.
STATISTIC_CATEGORIES = {
    "activations": "stats/activations/",
    "activation gradients": "stats/activation_grads/",
    "parameters": "stats/params/",
}
#: The recipe CNN's values with statistics: its modules' outputs and the post-ReLU values it sows.
LAYERS = ("Conv_0", "Conv_0_relu", "Conv_1", "Conv_1_relu", "Dense_0", "Dense_0_relu", "Dense_1")
#: The most tags the default pages may list (over every run, scalars and histograms).
MAX_TAGS = 30

RECIPE_TIMEOUT_S = 240
SERVER_START_TIMEOUT_S = 60
HTTP_TIMEOUT_S = 15

# Runs the recipe as a person would call it, and reports what the test must
# compare with: the final evaluation and the parameter count of the CNN.
_RECIPE = """
import json, sys
import jax, jax.numpy as jnp
from recipes.mnist import Config, train_and_evaluate
from recipes.models import CNN

result = train_and_evaluate(Config(epochs=1, log_every=5, stats_every=10, download=False), sys.argv[1])
params = CNN().init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))["params"]
result["parameters"] = sum(leaf.size for leaf in jax.tree.leaves(params))
print("RESULT " + json.dumps(result), flush=True)
"""


@dataclass(frozen=True)
class Served:
    """A recipe run's logdir served by TensorBoard, and what the recipe returned."""

    url: str  # the server's address, without a trailing slash
    logdir: Path  # the run's TensorBoard directory (WORKDIR/tensorboard)
    result: Mapping[str, float]  # the final eval metrics, steps and the CNN's parameter count

    def get(self, path: str, **query: str) -> Any:
        """The JSON that ``GET path?query`` answers."""
        suffix = "?" + urllib.parse.urlencode(query) if query else ""
        return self._fetch(urllib.request.Request(self.url + path + suffix))

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        """The JSON that ``POST path`` answers to a JSON body (as TensorBoard's frontend sends it)."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        return self._fetch(request)

    def _fetch(self, request: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            pytest.fail(f"TensorBoard answered {request.full_url} with {error.code}: {error.read()[:2000]!r}")

    def scalar_tags(self) -> dict[str, set[str]]:
        """``{run: {tag, ...}}`` as the scalars plugin lists them."""
        return {run: set(tags) for run, tags in self.get("/data/plugin/scalars/tags").items()}


def _run_recipe(workdir: Path) -> dict[str, float]:
    """Runs the recipe in a subprocess on two fake CPU devices; returns what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["FLAXHOOKS_CACHE"] = str(ROOT / ".no-cache-for-tests")  # never a real download cache
    try:
        done = subprocess.run([sys.executable, "-c", _RECIPE, str(workdir)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the recipe ran past {RECIPE_TIMEOUT_S} s: {str(timeout.stderr)[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        pytest.fail(f"the recipe failed (exit {done.returncode}):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A one-epoch recipe run, served by TensorBoard for every test of this module."""
    workdir = tmp_path_factory.mktemp("recipe")
    result = _run_recipe(workdir)
    logdir = workdir / "tensorboard"
    with tensorboard(logdir, tmp_path_factory.mktemp("server") / "tensorboard.log") as url:
        yield Served(url, logdir, result)


@pytest.fixture(scope="module")
def served_from_parent(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The same run served from its parent directory, as when several runs are
    compared: the runs are then ``tensorboard``, ``tensorboard/train``, ..."""
    with tensorboard(served.logdir.parent, tmp_path_factory.mktemp("server") / "tensorboard.log") as url:
        # Served.logdir is the run directory inside the served one.
        yield Served(url, served.logdir, served.result)


def _matched(regexes: list[str], tags: set[str]) -> set[str]:
    """The tags a Custom Scalars chart draws: those a regex matches from the start (as the plugin does)."""
    compiled = [re.compile(regex) for regex in regexes]
    return {tag for tag in tags if any(regex.match(tag) for regex in compiled)}


def _chart_regexes(chart: Mapping[str, Any]) -> list[str]:
    """A chart's tag regexes, multiline or margin."""
    if "multiline" in chart:
        return list(chart["multiline"].get("tag", []))
    return [series["value"] for series in chart.get("margin", {}).get("series", [])]


def test_the_runs_are_the_main_run_train_the_evaluation_and_one_per_layer(served: Served) -> None:
    runs = served.get("/data/runs")
    expected = [".", "train", EVAL_RUN, *(f"layers/{layer}" for layer in LAYERS)]
    assert sorted(runs) == sorted(expected), (
        f"TensorBoard lists the runs {runs}: expected the main run '.', 'train', '{EVAL_RUN}' and one run "
        f"per layer, no other (no stray hparams run)"
    )


def test_train_and_eval_log_the_same_tag_names(served: Served) -> None:
    tags = served.scalar_tags()
    for run in ("train", EVAL_RUN):
        missing = {"loss", "accuracy"} - tags.get(run, set())
        assert not missing, (
            f"run {run!r} lacks the scalars {sorted(missing)}; it has {sorted(tags.get(run, []))}"
        )
    # The eval curve ends at what the recipe returned as its final evaluation.
    for metric in ("loss", "accuracy"):
        points = served.get("/data/plugin/scalars/scalars", run=EVAL_RUN, tag=metric)
        assert points, f"no {EVAL_RUN}/{metric} points"
        _, step, value = points[-1]
        assert step == served.result["steps"], points
        assert value == pytest.approx(served.result[metric], rel=1e-5), (metric, points)


def test_custom_scalars_first_category_draws_train_and_eval_together(served: Served) -> None:
    layout = served.get("/data/plugin/custom_scalars/layout")
    assert layout.get("category"), f"no Custom Scalars layout: {layout}"
    first = layout["category"][0]
    charts = {chart["title"]: chart for chart in first.get("chart", [])}
    for title in ("loss", "accuracy"):
        assert title in charts, (
            f"the first category {first.get('title')!r} has no {title!r} chart: {sorted(charts)}"
        )
        regexes = _chart_regexes(charts[title])
        assert _matched(regexes, {title}) == {title}, (
            f"the {title!r} chart's regexes {regexes} miss {title!r}"
        )
        # Drawn for both runs: the plugin's own route finds the tag in each.
        for run in ("train", EVAL_RUN):
            found = {}
            for regex in regexes:
                answer = served.get("/data/plugin/custom_scalars/scalars", run=run, tag=regex)
                assert answer["regex_valid"], f"invalid regex {regex!r}"
                found.update(answer["tag_to_events"])
            assert found.get(title), f"the {title!r} chart draws nothing for run {run!r}: {sorted(found)}"


@pytest.mark.parametrize(("title", "prefix"), STATISTIC_CATEGORIES.items(), ids=list(STATISTIC_CATEGORIES))
def test_custom_scalars_one_chart_per_statistic_a_line_per_layer_run(
    served: Served, title: str, prefix: str
) -> None:
    layout = served.get("/data/plugin/custom_scalars/layout")
    categories = {category["title"]: category.get("chart", []) for category in layout.get("category", [])}
    assert title in categories, f"no Custom Scalars category {title!r}"
    tags_by_run = served.scalar_tags()
    layer_runs = {run: tags for run, tags in tags_by_run.items() if run.startswith("layers/")}
    logged = {tag for tags in layer_runs.values() for tag in tags if tag.startswith(prefix)}
    assert logged, f"no layer run logs a {prefix}<statistic> tag: {layer_runs}"
    drawn: dict[str, str] = {}  # tag -> the chart that draws it
    for chart in categories[title]:
        regexes = _chart_regexes(chart)
        tags = _matched(regexes, logged)
        assert len(tags) == 1, f"chart {title}/{chart['title']} should draw one tag, draws {sorted(tags)}"
        (tag,) = tags
        assert tag not in drawn, f"{tag} is drawn by both {drawn[tag]!r} and {chart['title']!r}"
        drawn[tag] = chart["title"]
        # A line per layer: the plugin's own route finds the tag in every layer run that logs it.
        logging_it = {run for run, run_tags in layer_runs.items() if tag in run_tags}
        for run in logging_it:
            found: dict[str, Any] = {}
            for regex in regexes:
                answer = served.get("/data/plugin/custom_scalars/scalars", run=run, tag=regex)
                assert answer["regex_valid"], f"invalid regex {regex!r}"
                found.update(answer["tag_to_events"])
            assert found.get(tag), f"chart {title}/{chart['title']} draws nothing for {run!r}"
        if prefix != "stats/activations/" or not tag.endswith("zero_fraction"):
            assert len(logging_it) >= 4, f"{tag}: only {sorted(logging_it)} (every module should have a line)"
    assert set(drawn) == logged, f"category {title!r} draws no chart of {sorted(logged - set(drawn))}"


def test_statistics_that_span_orders_of_magnitude_are_charted_as_their_log10(served: Served) -> None:
    for run in (f"layers/{layer}" for layer in ("Conv_0", "Dense_1")):
        points = served.get("/data/plugin/scalars/scalars", run=run, tag="stats/activation_grads/log10_rms")
        assert points and all(-12 < value < 2 for _, _, value in points), (run, points)


def _metric(name: Mapping[str, str]) -> tuple[str, str]:
    """A metric's (group, tag); the JSON leaves out an empty group."""
    return name.get("group", ""), name["tag"]


def _check_hparams(served: Served, session: str) -> None:
    """The HParams tab lists ``session`` alone, with the recipe's settings,
    the parameter count and the final eval metrics."""
    # The bodies TensorBoard's frontend sends (hparams_data_source.ts), but
    # asking for metrics, as its HParams tab (the Polymer dashboard) does.
    experiment = served.post("/data/plugin/hparams/experiment",
                             {"experimentName": "", "hparamsLimit": 1000, "includeMetrics": True})
    names = [info["name"] for info in experiment.get("hparamInfos", [])]
    missing = ({*HPARAMS, PARAMETER_COUNT_HPARAM}) - set(names)
    assert not missing, f"the HParams table lacks the columns {sorted(missing)}; it has {names}"
    metrics = [_metric(info["name"]) for info in experiment.get("metricInfos", [])]
    for metric in RESULTS.values():
        assert metric in metrics, f"no metric column {metric} (group, tag); the columns are {metrics}"

    groups = served.post("/data/plugin/hparams/session_groups", {
        "experimentName": "",
        "allowedStatuses": ["STATUS_FAILURE", "STATUS_RUNNING", "STATUS_SUCCESS", "STATUS_UNKNOWN"],
        "colParams": [{"hparam": name, "includeInResult": True} for name in names],
        "startIndex": 0,
        "sliceSize": 1_000_000,
        "includeMetrics": True,
    })["sessionGroups"]
    sessions = [one["name"] for group in groups for one in group["sessions"]]
    assert sessions == [session], f"expected one session, the run {session!r}, got {sessions}"
    hparams = groups[0]["hparams"]
    for name, value in HPARAMS.items():
        assert hparams.get(name) == pytest.approx(value), (name, hparams)
    assert hparams.get(PARAMETER_COUNT_HPARAM) == served.result["parameters"], hparams
    values = {_metric(value["name"]): value for value in groups[0]["sessions"][0]["metricValues"]}
    for metric, name in RESULTS.items():
        value = values.get(name)
        # TensorBoard reads a metric from the run os.path.join(session, group).
        assert value is not None, (
            f"no value of {name} in session {session!r}: TensorBoard reads it from run "
            f"{os.path.join(session, name[0])!r} (runs: {served.get('/data/runs')}); "
            f"the session has values of {sorted(values)}"
        )
        assert value["value"] == pytest.approx(served.result[metric], rel=1e-5), value
        assert value["trainingStep"] == served.result["steps"], value


def test_hparams_of_the_main_run_with_the_final_eval_metrics(served: Served) -> None:
    # TensorBoard opened on the run's own logdir, as the recipe says to.
    _check_hparams(served, ".")


def test_hparams_when_runs_are_compared_from_their_parent_directory(served_from_parent: Served) -> None:
    # TensorBoard opened on a directory of runs, to compare them in the HParams tab.
    _check_hparams(served_from_parent, served_from_parent.logdir.name)


def test_the_default_pages_list_at_most_30_tags_as_the_docs_count_them(served: Served) -> None:
    scalars = set().union(*served.scalar_tags().values())
    histograms = set().union(*map(set, served.get("/data/plugin/histograms/tags").values()))
    tags = scalars | histograms
    assert len(tags) <= MAX_TAGS, f"{len(tags)} distinct tags (at most {MAX_TAGS}): {sorted(tags)}"
    page = " ".join((ROOT / "docs" / "guides" / "inside-the-model.md").read_text().split())
    stated = re.search(r"the main command writes (\d+) distinct scalar tags \((\d+) of them the statistics "
                       r"callbacks', .*?\) and (\d+) histogram tags over its runs: (\d+) names", page)
    assert stated, "the docs' sentence on the recipe's tags"
    stats = {t for t in scalars if t.startswith("stats/")}
    assert [int(n) for n in stated.groups()] == [len(scalars), len(stats), len(histograms), len(tags)], \
        (sorted(scalars), sorted(histograms))
