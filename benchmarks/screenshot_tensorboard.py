"""Screenshots of TensorBoard as a person opening it on an MNIST recipe run sees it.

What it does
    Runs a short MNIST recipe (``python -m recipes.mnist --epochs 2
    --log-every 5 --stats-every 10 --no-download`` on the bundled sample,
    62 steps on two CPU devices: two epochs, so the eval curve has two
    points and shows as a line), or takes the TensorBoard logdir of a
    run you already have (``--logdir``); serves it with the ``tensorboard``
    package's own server on a free local port; and screenshots, with headless
    Chromium, the page TensorBoard opens on (Time Series), its Custom Scalars
    tab and its HParams tab:

        benchmarks/tensorboard.png                  the opened page
        benchmarks/tensorboard_custom_scalars.png   #custom_scalars
        benchmarks/tensorboard_hparams.png          #hparams
        benchmarks/tensorboard_layers.png           Time Series filtered to the per-layer
                                                    charts: a line per layer, log10 scales

    The server loads the whole logdir before it answers. Each page opens in
    a fresh headless Chromium driven over the DevTools protocol
    (``--remote-debugging-pipe``): the screenshot is taken once the page has
    stopped changing (the same pixels for ``--settle-s`` seconds, after at
    least that long), so charts that TensorBoard draws late, off the main
    thread, are in it; ``--timeout-s`` bounds the wait. The server and the
    browsers are always stopped.

Needs
    Chromium: on Debian or Ubuntu ``apt-get install chromium`` (the Debian
    package ``chromium``), or ``--chromium PATH`` to any Chrome or Chromium;
    and ``pip install tensorboard``.

How to run
    python -m benchmarks.screenshot_tensorboard [--logdir DIR | --epochs 2] [--out-dir docs/images]
        [--settle-s 3] [--timeout-s 60] [--window-size 1400,1000] [--chromium PATH]

    The last line of output is one JSON object naming the screenshots.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The per-layer statistics' tags (one run per layer draws a line on each), not their histograms or counters.
LAYER_TAGS = "^stats/(activations|activation_grads|params)/(mean|zero_fraction|log10_[a-z_]+)$"
#: Screenshot file name -> the page's URL after the server's address ("" is the page TensorBoard opens on).
PAGES = {
    "tensorboard.png": "",
    "tensorboard_custom_scalars.png": "#custom_scalars",
    "tensorboard_hparams.png": "#hparams",
    # Time Series showing only the per-layer charts (its tag filter, as a person types it).
    "tensorboard_layers.png": "?" + urllib.parse.urlencode({"tagFilter": LAYER_TAGS}) + "#timeseries",
}
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

RECIPE_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 120
BROWSER_CALL_TIMEOUT_S = 60


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.screenshot_tensorboard",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, default=None,
                        help="a run's TensorBoard logdir (WORKDIR/tensorboard); default: run a short recipe")
    parser.add_argument("--epochs", type=int, default=2,
                        help="epochs of the recipe run (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "images",
                        help="where the PNGs go (default: benchmarks/)")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="screenshot once a page has looked the same this long (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="the longest to wait for a page to settle (default: %(default)s)")
    parser.add_argument("--window-size", default="1400,1000",
                        help="browser window, WIDTH,HEIGHT (default: %(default)s)")
    parser.add_argument("--chromium", default=None,
                        help="the Chromium or Chrome executable (default: found on PATH)")
    return parser.parse_args(argv)


def find_chromium(given: str | None) -> str:
    """The browser to run, or SystemExit saying how to install one."""
    for name in ([given] if given else CHROMIUM_NAMES):
        if found := shutil.which(name):
            return found
    raise SystemExit(
        f"no Chromium found ({given or ', '.join(CHROMIUM_NAMES)}): install Debian's 'chromium' package "
        f"(apt-get install chromium) or pass --chromium PATH to a Chrome or Chromium executable"
    )


def run_recipe(workdir: Path, epochs: int) -> Path:
    """Runs the MNIST recipe on the bundled sample into ``workdir``; returns its TensorBoard logdir."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "recipes.mnist", "--workdir", str(workdir), "--epochs", str(epochs),
               "--log-every", "5", "--stats-every", "10", "--no-download", "--cpu-devices", "2"]
    print("running", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RECIPE_TIMEOUT_S)
    if done.returncode:
        raise SystemExit(f"the recipe failed (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return workdir / "tensorboard"


@contextlib.contextmanager
def tensorboard(logdir: Path, log: Path, fast: bool = False) -> Iterator[str]:
    """Serves ``logdir`` with the real TensorBoard; yields its URL, and always stops it.

    ``fast``: read the logdir as ``tensorboard --logdir`` does by default, with
    its Rust data server (it keeps one event per step of a tag, and drops
    later steps when an earlier one comes after them), in the background:
    poll until what is asked for shows.
    """
    executable = Path(sys.executable).with_name("tensorboard")
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "tensorboard.main"]
    # Port 0: the server picks a free port and prints it. A blocking load of
    # the whole logdir first: the pages then show every point of the run.
    command += ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    command += (["--load_fast", "true", "--reload_interval", "1"] if fast else
                ["--load_fast", "false", "--reload_interval", "0", "--reload_task", "blocking"])
    with open(log, "w") as output:
        # A file, not a pipe nobody reads, which could fill and stall the server.
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            said = log.read_text(errors="replace")
            if found := re.search(r"http://127\.0\.0\.1:(\d+)/", said):
                url = f"http://127.0.0.1:{found.group(1)}/"
                with contextlib.suppress(OSError), urllib.request.urlopen(url + "data/runs", timeout=10):
                    break
            if server.poll() is not None:
                raise SystemExit(f"tensorboard exited with {server.returncode}:\n{said[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"tensorboard did not answer within {SERVER_START_TIMEOUT_S} s:\n{said[-3000:]}"
                )
            time.sleep(0.25)
        yield url
    finally:
        if server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: JSON messages ending in NUL, read by the
    browser on its fd 3 and written on its fd 4); no WebSocket library needed."""

    def __init__(self, chromium: str, profile: Path, window_size: str, log: Path):
        to_browser, self._send = os.pipe()
        self._receive, from_browser = os.pipe()
        command = [
            chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            # A fresh profile: TensorBoard keeps settings in local storage, so
            # every screenshot shows what a first visit shows.
            f"--user-data-dir={profile}", "--no-first-run", "--mute-audio",
            f"--window-size={window_size}", "--remote-debugging-pipe", "about:blank",
        ]
        with open(log, "a") as output:
            # bash (Debian's sh refuses fds above 9) puts the pipe ends on fds 3 and 4, then becomes Chromium.
            self.process = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{to_browser} 4>&{from_browser}', "bash", *command],
                pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        os.close(to_browser)
        os.close(from_browser)
        self._log = log
        self._buffer = b""
        self._last_id = 0

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> Any:
        """Sends one command and returns its result (events in between are skipped)."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._send, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + BROWSER_CALL_TIMEOUT_S
        while True:
            answer = self._read(deadline, method)
            if answer.get("id") == self._last_id:
                if "error" in answer:
                    raise SystemExit(f"chromium: {method} failed: {answer['error']}")
                return answer.get("result", {})

    def _read(self, deadline: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._receive], [], [], left)[0]:
                raise SystemExit(f"chromium did not answer {method} within {BROWSER_CALL_TIMEOUT_S} s")
            chunk = os.read(self._receive, 1 << 20)
            if not chunk:
                said = self._log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"chromium exited ({self.process.poll()}) during {method}:\n{said}")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def close(self) -> None:
        """Closes the browser, and kills it and its helpers if it lingers."""
        with contextlib.suppress(OSError, SystemExit):
            os.write(self._send, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its renderer and GPU processes too
        self.process.wait(timeout=10)
        os.close(self._send)
        os.close(self._receive)


def screenshot(chromium: str, url: str, path: Path, window_size: str, settle_s: float, timeout_s: float,
               scratch: Path) -> float:
    """Opens ``url`` in a fresh headless Chromium and saves the page as ``path``
    once it has stopped changing; returns the seconds that took."""
    width, height = (int(n) for n in window_size.split(","))
    browser = Browser(chromium, scratch / f"profile-{path.stem}", window_size, scratch / "chromium.log")
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.call("Emulation.setDeviceMetricsOverride",
                     {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        browser.call("Page.enable", session=session)
        started = time.monotonic()
        browser.call("Page.navigate", {"url": url}, session)
        # Poll the pixels: TensorBoard fetches data and draws its charts (some
        # in a worker) well after the load event, so no event says "done".
        previous, same_since = b"", started
        while True:
            time.sleep(0.5)
            captured = browser.call("Page.captureScreenshot", {"format": "png"}, session)
            shot = base64.b64decode(captured["data"])
            now = time.monotonic()
            if shot != previous:
                previous, same_since = shot, now
            elif now - same_since >= settle_s:
                break
            if now - started > timeout_s:
                print(f"warning: {url} still changed after {timeout_s:g} s; saving it as it is", flush=True)
                break
        path.write_bytes(previous)
        return now - started
    finally:
        browser.close()


def colours(path: Path) -> int | None:
    """How many colours the screenshot has (a blank or loading page has few); None without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return None
    with Image.open(path) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24) or [])


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    chromium = find_chromium(args.chromium)  # before the recipe: fail fast
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="screenshot-tensorboard-") as scratch:
        logdir = args.logdir or run_recipe(Path(scratch) / "run", args.epochs)
        if not logdir.is_dir():
            raise SystemExit(f"no logdir {logdir}")
        shots: dict[str, dict[str, object]] = {}
        with tensorboard(logdir, Path(scratch) / "tensorboard.log") as url:
            print(f"tensorboard serves {logdir} at {url}", flush=True)
            for name, fragment in PAGES.items():
                path = args.out_dir / name
                seconds = screenshot(chromium, url + fragment, path, args.window_size, args.settle_s,
                                     args.timeout_s, Path(scratch))
                shots[name] = {"path": str(path), "url_fragment": fragment, "seconds": round(seconds, 1),
                               "colours": colours(path)}
                print(f"{url + fragment} -> {path} (settled after {seconds:.1f} s, "
                      f"{shots[name]['colours']} colours)", flush=True)
    result = {"benchmark": "screenshot_tensorboard", "logdir": str(args.logdir) if args.logdir else None,
              "settle_s": args.settle_s, "window_size": args.window_size, "screenshots": shots}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
