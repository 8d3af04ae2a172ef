"""Pictures of ``Diagnose``'s findings: in the terminal, and in TensorBoard.

What it does
    Trains a small CNN broken on purpose (``BrokenCNN``) for 300 steps on
    synthetic 16x16 images made here (ten classes, each a fixed random
    pattern plus noise; nothing is downloaded), batches of 64, with
    ``Diagnose(every=1, window=50, report_dir=...)``, ``Progress`` and
    ``TensorBoard(logdir, every=10)``. What is broken: ``conv2``'s bias
    starts at -4 (most of its ReLU units are dead), ``hidden``'s kernel
    starts 16 times too large in front of a tanh (saturation), and ``head``
    starts with tiny weights under Adam at 3e-3 (its updates are far above
    1e-3 of its parameters).

    The terminal: ``Progress`` draws on a recording rich console
    (``force_terminal=True``, ``--width`` columns), and logging writes to
    that console's terminal (``logging.basicConfig(format="%(message)s")``,
    as the recipes do), so ``Progress`` reroutes the findings above its bar
    as it does on a real terminal; ``Diagnose(console=...)`` prints its
    end-of-fit table there too. What the terminal shows at the end is
    rebuilt from the recording (the bar's redraws overwrite each other, the
    compiling spinner is erased) and saved as SVG, long log lines wrapped at
    words:

        benchmarks/diagnose_terminal.svg

    TensorBoard: the run's logdir is served and screenshotted with the
    machinery of ``benchmarks/screenshot_tensorboard.py`` (the real
    TensorBoard, headless Chromium, a screenshot once the page has stopped
    changing), then the PNGs are reduced to a 256-colour palette:

        benchmarks/diagnose_tensorboard_images.png   the Images tab: the three heatmaps
        benchmarks/diagnose_tensorboard_health.png   the Text tab: the findings, as written

    With ``--no-browser`` (or when no Chromium is found) the heatmaps that
    ``report_dir`` keeps are copied instead, as
    ``benchmarks/diagnose_{gradient_rms,dead_units,update_ratio}.png``.

Needs
    Chromium and ``tensorboard`` (see ``benchmarks/screenshot_tensorboard.py``),
    Pillow for the palette.

How to run
    python -m benchmarks.screenshot_diagnose [--out-dir docs/images] [--steps 300] [--width 110]
        [--settle-s 3] [--timeout-s 60] [--window-size 1400,1000] [--chromium PATH] [--no-browser]

    The last line of output is one JSON object naming the files and the findings.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.control import ControlType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text

import flaxhooks
from benchmarks.screenshot_tensorboard import colours, find_chromium, screenshot, tensorboard

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10
#: Screenshot file name -> the page's URL after the server's address.
PAGES = {
    "diagnose_tensorboard_images.png": "#images",
    "diagnose_tensorboard_health.png": "#text",
}
HEATMAPS = ("gradient_rms", "dead_units", "update_ratio")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.screenshot_diagnose",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "images",
                        help="where the SVG and PNGs go (default: benchmarks/)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default: %(default)s)")
    parser.add_argument("--width", type=int, default=110,
                        help="the terminal's columns (default: %(default)s)")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="screenshot once a page has looked the same this long (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="the longest to wait for a page to settle (default: %(default)s)")
    parser.add_argument("--window-size", default="1400,1000",
                        help="browser window, WIDTH,HEIGHT (default: %(default)s)")
    parser.add_argument("--chromium", default=None,
                        help="the Chromium or Chrome executable (default: found on PATH)")
    parser.add_argument("--no-browser", action="store_true",
                        help="no TensorBoard screenshots: copy report_dir's heatmaps instead")
    return parser.parse_args(argv)


# -- the broken model and its data ---------------------------------------------


class BrokenCNN(nn.Module):
    """A small CNN with three things wrong, each a common mistake."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        # A large negative bias: most units never fire, so they never learn.
        x = nn.relu(nn.Conv(32, (3, 3), bias_init=nn.initializers.constant(-4.0), name="conv2")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        # An init scale 16 times too large in front of a tanh: its units sit on the flat parts.
        x = jnp.tanh(nn.Dense(64, kernel_init=nn.initializers.variance_scaling(256.0, "fan_in", "normal"),
                              name="hidden")(x))
        # Tiny output weights: Adam's steps are far larger than the weights they change.
        return nn.Dense(CLASSES, kernel_init=nn.initializers.normal(1e-4), name="head")(x)


def make_data(n: int = 2048, seed: int = 0) -> dict[str, np.ndarray]:
    """Ten classes of 16x16 images: a fixed random pattern per class plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(CLASSES, 16, 16, 1))
    labels = rng.integers(0, CLASSES, n)
    images = patterns[labels] + rng.normal(scale=1.5, size=(n, 16, 16, 1))
    return {"image": images.astype(np.float32), "label": labels.astype(np.int32)}


def cross_entropy(logits: jnp.ndarray, batch: dict[str, jnp.ndarray]) -> jnp.ndarray:
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- the terminal ----------------------------------------------------------------


class ConsoleTerminal(io.TextIOBase):
    """The terminal a console draws on, as a stream: a logging handler that
    writes here is one ``Progress`` reroutes above its bar (it is a terminal),
    and what it writes outside a fit is printed through the console."""

    def __init__(self, console: Console):
        self.console = console

    def isatty(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.console.print(text.rstrip("\n"), markup=False, highlight=False, emoji=False, soft_wrap=True)
        return len(text)


def final_screen(segments: Iterable[Segment]) -> list[list[tuple[str, Style | None]]]:
    """What a terminal shows once ``segments`` (a recording, with rich's cursor
    moves and erasures) are written to it: its lines, as (character, style)
    cells. Lines are kept whole, not folded at the terminal's width."""
    lines: list[list[tuple[str, Style | None]]] = [[]]
    row = col = 0
    for segment in segments:
        if segment.control:
            for code, *params in segment.control:
                if code == ControlType.CARRIAGE_RETURN:
                    col = 0
                elif code == ControlType.CURSOR_UP:
                    row = max(0, row - int(params[0] if params else 1))
                elif code == ControlType.CURSOR_DOWN:
                    row += int(params[0] if params else 1)
                elif code == ControlType.CURSOR_MOVE_TO_COLUMN:
                    col = int(params[0])
                elif code == ControlType.ERASE_IN_LINE:
                    mode = int(params[0]) if params else 0
                    line = lines[row] if row < len(lines) else []
                    if mode == 2:
                        line.clear()
                    elif mode == 0:
                        del line[col:]
                    else:
                        line[:col] = [(" ", None)] * min(col, len(line))
                while row >= len(lines):
                    lines.append([])
            continue
        for i, part in enumerate(segment.text.split("\n")):
            if i:
                row, col = row + 1, 0
                while row >= len(lines):
                    lines.append([])
            line = lines[row]
            for char in part:
                if col < len(line):
                    line[col] = (char, segment.style)
                else:
                    line.extend([(" ", None)] * (col - len(line)))
                    line.append((char, segment.style))
                col += 1
    while lines and not lines[-1]:
        lines.pop()
    return lines


def save_terminal_svg(recording: Console, path: Path, title: str) -> None:
    """Saves what the recording console's terminal shows at the end as SVG,
    its long lines wrapped at words to the console's width."""
    screen = final_screen(recording._record_buffer)  # the recording, controls included
    out = Console(record=True, width=recording.width, file=io.StringIO(), force_terminal=True,
                  color_system="truecolor")
    for cells in screen:
        text = Text(no_wrap=False, overflow="fold")
        for char, style in cells:
            text.append(char, style)
        text.rstrip()
        out.print(text, highlight=False)
    out.save_svg(str(path), title=title)


# -- the run ---------------------------------------------------------------------


def train(logdir: Path, report_dir: Path, steps: int, console: Console) -> flaxhooks.Diagnose:
    """Trains the broken model with Diagnose, Progress and TensorBoard; returns the Diagnose."""
    diagnose = flaxhooks.Diagnose(every=1, window=50, report_dir=report_dir, console=console)
    callbacks = [flaxhooks.Progress(console=console), diagnose, flaxhooks.TensorBoard(logdir, every=10)]
    trainer = flaxhooks.Trainer(BrokenCNN(), optax.adam(3e-3), cross_entropy, callbacks=callbacks)
    trainer.fit(flaxhooks.ArrayLoader(make_data(), 64, seed=0), steps=steps)
    return diagnose


def to_palette(path: Path) -> None:
    """Rewrites a PNG with a 256-colour palette (screenshots are mostly flat colours), if Pillow is here."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=0)
    small.save(path, optimize=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    chromium = None
    if not args.no_browser:
        try:
            chromium = find_chromium(args.chromium)
        except SystemExit as missing:
            print(f"warning: {missing}; copying report_dir's heatmaps instead of screenshots", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="screenshot-diagnose-") as scratch_dir:
        scratch = Path(scratch_dir)
        logdir, report_dir = scratch / "tensorboard", scratch / "report"
        console = Console(record=True, width=args.width, force_terminal=True, color_system="truecolor",
                          file=io.StringIO())
        # As the recipes configure logging, on the (recorded) terminal.
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=ConsoleTerminal(console),
                            force=True)
        diagnose = train(logdir, report_dir, args.steps, console)
        svg = args.out_dir / "diagnose_terminal.svg"
        save_terminal_svg(console, svg, "python -m benchmarks.screenshot_diagnose")
        files[svg.name] = {"path": str(svg)}
        if chromium is None:
            for name in HEATMAPS:
                path = args.out_dir / f"diagnose_{name}.png"
                shutil.copyfile(report_dir / f"{name}.png", path)
                files[path.name] = {"path": str(path)}
        else:
            with tensorboard(logdir, scratch / "tensorboard.log") as url:
                print(f"tensorboard serves {logdir} at {url}", flush=True)
                for name, fragment in PAGES.items():
                    path = args.out_dir / name
                    seconds = screenshot(chromium, url + fragment, path, args.window_size, args.settle_s,
                                         args.timeout_s, scratch)
                    to_palette(path)
                    files[name] = {"path": str(path), "url_fragment": fragment, "seconds": round(seconds, 1),
                                   "colours": colours(path)}
                    print(f"{url + fragment} -> {path} (settled after {seconds:.1f} s)", flush=True)
    for entry in files.values():
        entry["bytes"] = Path(entry["path"]).stat().st_size
    result = {"benchmark": "screenshot_diagnose", "steps": args.steps, "width": args.width,
              "findings": [{"kind": f.kind, "layer": f.layer, "step": f.step} for f in diagnose.findings],
              "files": files}
    print(json.dumps(result), file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
