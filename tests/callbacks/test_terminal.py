"""What a person running a fit in a terminal sees: one bar line, with every log
line, warning and evaluation printed whole above it; and, off a terminal, lines
that are never squeezed or rerouted."""

from __future__ import annotations

import fcntl
import io
import itertools
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import warnings
from pathlib import Path

import optax
import pytest
from rich.console import Console

import flaxhooks
from flaxhooks import Callback, CallbackError, Progress, Summary
from tests.callbacks.test_summary import PER_DEVICE, Nested, batches, loss_fn
from tests.helpers import make_arrays, make_batches, sgd_trainer

ROOT = Path(__file__).resolve().parents[2]
COLUMNS, ROWS = 80, 30

# A short real fit, as the recipe sets logging up: evaluation every 4 steps,
# a checkpoint at each epoch's end (its "saved checkpoint" INFO line comes
# from the saving thread), and a logged warning and a Python warning mid-fit.
FIT = """
import logging, sys, warnings
logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("flaxhooks").setLevel(logging.INFO)
import flaxhooks
from tests.helpers import make_arrays, make_batches, sgd_trainer

class Chatty(flaxhooks.Callback):
    def on_step_end(self, loop):
        if loop.step == 3:
            logging.getLogger("user").warning("a logged warning at step 3")
            warnings.warn("a Python warning at step 3")

trainer = sgd_trainer(callbacks=[
    flaxhooks.Evaluate(make_arrays(32), every=flaxhooks.Every(steps=4), batch_size=16),
    flaxhooks.Checkpoint(sys.argv[1]),
    flaxhooks.Progress(refresh_per_second=1000),  # a redraw at every step
    Chatty(),
])
trainer.fit(make_batches(4), epochs=2)
"""


def run_in_terminal(args: list[str], timeout: float = 120, columns: int = COLUMNS) -> tuple[int, str]:
    """Runs ``args`` with stdin, stdout and stderr on a pseudo-terminal of
    ``columns`` x ROWS; returns the exit status and every byte it wrote, decoded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES")}
    env.update(TERM="xterm", COLUMNS=str(columns))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, columns, 0, 0))
    process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the other end is closed, the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
        else:
            raise TimeoutError(b"".join(chunks).decode(errors="replace")[-3000:])
    finally:
        process.kill()
        process.wait()
        os.close(master)
    return process.returncode, b"".join(chunks).decode("utf-8", errors="replace")


class Terminal:
    """Enough of a VT100 of ``columns`` to replay what rich writes, keeping
    every row (nothing scrolls away).

    It knows text, CR, LF, cursor moves, erasing in a line, and ignores styles
    and the cursor's visibility; any other control is recorded in
    ``unknown``. A character written past the right margin wraps onto a new
    row, as in a real terminal: ``continued`` holds those rows, and ``wraps``
    what each wrapped row held, since a live display that wraps leaves debris
    when it is redrawn.
    """

    TOKEN = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b\][^\x07]*\x07|\x1b.|.", re.DOTALL)

    def __init__(self, columns: int):
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.continued: set[int] = set()
        self.wraps: list[str] = []
        self.unknown: set[str] = set()
        self.row = self.column = 0

    def feed(self, output: str) -> None:
        for match in self.TOKEN.finditer(output):
            token, params, command = match.group(0), match.group(1), match.group(2)
            if command is not None:
                self._control(params, command)
            elif token == "\r":
                self.column = 0
            elif token == "\n":
                self._move_to(self.row + 1)
            elif token == "\b":
                self.column = max(0, self.column - 1)
            elif token.startswith("\x1b") or token < " ":
                self.unknown.add(repr(token))
            else:
                self._put(token)

    def lines(self) -> list[str]:
        """The screen's lines, each wrapped line joined again, without trailing blanks."""
        lines: list[str] = []
        for index, row in enumerate(self.rows):
            text = "".join(row).rstrip()
            if index in self.continued and lines:
                lines[-1] += text
            else:
                lines.append(text)
        return [line for line in lines if line]

    def _put(self, char: str) -> None:
        if self.column >= self.columns:  # past the margin: the line wraps
            self.wraps.append("".join(self.rows[self.row]))
            self._move_to(self.row + 1)
            self.continued.add(self.row)
            self.column = 0
        row = self.rows[self.row]
        row.extend(" " * (self.column + 1 - len(row)))
        row[self.column] = char
        self.column += 1

    def _move_to(self, row: int) -> None:
        self.row = max(0, row)
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _control(self, params: str, command: str) -> None:
        count = int(params) if params.isdigit() else 1
        if command == "m" or params in ("?25", "?25l", "?25h") or params.startswith("?"):
            return  # styles, the cursor's visibility
        if command == "A":
            self._move_to(self.row - count)
        elif command == "B":
            self._move_to(self.row + count)
        elif command == "C":
            self.column = min(self.columns, self.column + count)
        elif command == "D":
            self.column = max(0, self.column - count)
        elif command == "G":
            self.column = count - 1
        elif command == "K":
            row = self.rows[self.row]
            mode = int(params or 0)
            if mode == 0:
                del row[self.column:]
            elif mode == 1:
                row[: self.column] = [" "] * min(self.column, len(row))
            else:
                row.clear()
        else:
            self.unknown.add(f"CSI {params}{command}")


@pytest.mark.slow
@pytest.mark.parametrize("columns", [80, 100])
def test_in_a_terminal_the_bar_stays_one_line_and_logs_and_the_summary_print_whole(tmp_path, columns):
    checkpoints = tmp_path / "checkpoints"
    status, output = run_in_terminal([sys.executable, "-c", FIT, str(checkpoints)], columns=columns)
    assert status == 0, output[-3000:]
    terminal = Terminal(columns)
    terminal.feed(output)
    assert not terminal.unknown, terminal.unknown

    # The spinner showed while the train step compiled, then went.
    assert "compiling the train step…" in output
    lines = terminal.lines()
    assert not any("compiling the train step…" in line for line in lines)

    # Nothing the bar, the spinner or the summary drew ever reached the margin: no line wraps mid-word
    # (but a log line holding a path longer than the terminal: the test's own long checkpoint directory).
    assert not [row for row in terminal.wraps if str(tmp_path)[:20] not in row], terminal.wraps
    unstyled = re.sub(r"\x1b\[[0-9;]*m", "", output)
    frames = [frame for frame in re.split(r"\r|\n|\x1b\[[0-9;?]*[A-Za-z]", unstyled)
              if frame.startswith("epoch ")]
    assert len(frames) >= 8 and max(len(frame) for frame in frames) < columns  # the last column kept blank
    assert any(re.search(r"loss \d", frame) for frame in frames)  # the eval dropped, the loss kept

    # What stays on screen: each line whole, one bar (its last frame), no debris of others.
    bars = [line for line in lines if line.startswith("epoch ") or "━" in line]
    assert len(bars) == 1 and re.match(r"epoch 2/2 ━+ 8/8 ", bars[0]) and len(bars[0]) <= columns, lines
    expected = [
        r"train step compiled: first step done after \d+\.\ds",
        r"a logged warning at step 3",
        r"UserWarning: a Python warning at step 3",
        r"eval at step 4 \(32 examples\): loss \S+  accuracy \S+$",
        rf"saved checkpoint at step 4 to {re.escape(str(checkpoints))}$",
        r"eval at step 8 \(32 examples\): loss \S+  accuracy \S+$",
        r"^done: step 8/8  epoch 2/2  \(8 steps in",
    ]
    for pattern in expected:
        assert any(re.search(pattern, line) for line in lines), (pattern, lines)
    done = next(i for i, line in enumerate(lines) if line.startswith("done:"))
    assert lines.index(bars[0]) < done  # the bar's last frame, then the summary below it
    # The summary, broken between fields into lines that fit: the last step's metrics, then the evaluation.
    summary = [lines[done], *itertools.takewhile(lambda line: line.startswith("  "), lines[done + 1:])]
    assert 2 <= len(summary) <= (4 if columns == 80 else 3), summary  # as wide as its figures are
    assert all(len(line) < columns for line in summary), summary
    text = " ".join(summary)
    assert re.search(r"\d ex/s\s+data \d+%", text), summary  # where the time went
    assert re.search(r"loss \S+ .*grad_norm \S+ .*update_ratio \S+ \(step 8\)", text), summary
    assert re.search(r"eval loss \S+  accuracy \S+", text), summary
    # The rate it gives is the bar's own (the same steps over the same time, the compilation left out).
    rate = re.search(r"8 steps in \S+, (\d+\.\d) steps/s", summary[0]).group(1)
    assert f"{rate} steps/s" in bars[0], (rate, bars[0])


# Ctrl-C in the middle of an epoch, as a person presses it.
WARNS = """            warnings.warn("a Python warning at step 3")"""
CTRL_C = FIT.replace(WARNS, WARNS + """
        if loop.step == 5:
            import os, signal
            os.kill(os.getpid(), signal.SIGINT)""").replace(
    "trainer.fit(make_batches(4), epochs=2)", """try:
    trainer.fit(make_batches(4), epochs=2)
except flaxhooks.TrainingInterrupted as stopped:
    print(f"to go on from step {stopped.step}: resume")""")


@pytest.mark.slow
def test_ctrl_c_says_once_that_training_stopped_and_where(tmp_path):
    status, output = run_in_terminal([sys.executable, "-c", CTRL_C, str(tmp_path / "checkpoints")])
    assert status == 0, output[-3000:]
    terminal = Terminal(COLUMNS)
    terminal.feed(output)
    lines = terminal.lines()
    assert not [row for row in terminal.wraps if str(tmp_path)[:20] not in row], terminal.wraps
    said = [line for line in lines if "stop" in line.lower()]
    assert len(said) == 2, lines  # the signal heard, and where training stopped: once each
    assert said[0] == "SIGINT: stopping at the next step boundary (press Ctrl-C again to stop at once)"
    assert re.match(r"stopped \(interrupted by SIGINT\) at step (\d+)/8  epoch 2/2", said[1]), said
    step = re.match(r"stopped \(interrupted by SIGINT\) at step (\d+)", said[1]).group(1)
    assert lines[-1] == f"to go on from step {step}: resume"
    saved = f"saved checkpoint at step {step} to {tmp_path / 'checkpoints'}"
    assert saved in lines, lines


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def terminal_console(width: int = 80) -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=width)


class Talks(Callback):
    """Logs on the root logger and on a library's logger, warns, and checks
    where each goes, at step 2; fails at step 3 if asked to."""

    def __init__(self, library: logging.Logger, fail: bool = False):
        self.library = library
        self.fail = fail
        self.seen: dict[str, object] = {}

    def on_step_end(self, loop):
        if loop.step == 2:
            self.seen = {"root": list(logging.root.handlers), "library": list(self.library.handlers),
                         "showwarning": warnings.showwarning}
            logging.getLogger("user").warning("a root warning")
            self.library.info("a library line")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn("a Python warning", stacklevel=1)
        if self.fail and loop.step == 3:
            raise ValueError("boom")


@pytest.mark.parametrize("fail", [False, True], ids=["done", "error"])
def test_handlers_and_showwarning_are_swapped_during_fit_and_restored_after(monkeypatch, fail):
    tty, pipe = FakeTTY(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", tty)
    basic = logging.StreamHandler(tty)
    basic.setFormatter(logging.Formatter("root: %(message)s"))
    to_a_file = logging.StreamHandler(pipe)  # not a terminal: left alone
    library = logging.getLogger("a_library")
    own = logging.StreamHandler(tty)
    own.setFormatter(logging.Formatter("library: %(message)s"))
    monkeypatch.setattr(library, "handlers", [own])
    monkeypatch.setattr(library, "propagate", False)
    monkeypatch.setattr(library, "level", logging.INFO)
    for handler in (basic, to_a_file):
        logging.root.addHandler(handler)
    root_before = list(logging.root.handlers)
    showwarning, last_resort = warnings.showwarning, logging.lastResort
    console = terminal_console()
    talks = Talks(library, fail)
    try:
        trainer = sgd_trainer(callbacks=[Progress(console=console), talks])
        if fail:
            with pytest.raises(CallbackError, match="boom"):
                trainer.fit(make_batches(4), epochs=1)
        else:
            trainer.fit(make_batches(4), epochs=1)
        after = list(logging.root.handlers)
    finally:
        for handler in (basic, to_a_file):
            logging.root.removeHandler(handler)

    # During the fit: swapped in place, the others untouched.
    assert basic not in talks.seen["root"] and to_a_file in talks.seen["root"]
    assert talks.seen["root"].index(to_a_file) == root_before.index(to_a_file)
    assert own not in talks.seen["library"] and len(talks.seen["library"]) == 1
    assert talks.seen["showwarning"] is not showwarning
    printed = console.file.getvalue()
    assert "root: a root warning" in printed and "library: a library line" in printed
    assert "UserWarning: a Python warning" in printed
    assert tty.getvalue() == ""  # nothing went around the console
    assert "a root warning" in pipe.getvalue()  # the file handler still got it, itself
    # After: exactly as before.
    assert after == root_before and all(a is b for a, b in zip(after, root_before, strict=True))
    assert library.handlers == [own]
    assert warnings.showwarning is showwarning and logging.lastResort is last_resort


class During(Callback):
    """Runs ``act`` at step 2."""

    def __init__(self, act):
        self.act = act

    def on_step_end(self, loop):
        if loop.step == 2:
            self.act()


def test_with_no_handler_the_last_resort_prints_through_the_console(monkeypatch):
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    monkeypatch.setattr(logging.root, "handlers", [])
    console, last_resort = terminal_console(), logging.lastResort
    seen = []

    def log():
        seen.append(logging.lastResort)
        logging.getLogger("nobody").warning("no handler anywhere")

    sgd_trainer(callbacks=[Progress(console=console), During(log)]).fit(make_batches(4), epochs=1)
    assert seen[0] is not last_resort and logging.lastResort is last_resort
    assert "no handler anywhere" in console.file.getvalue() and sys.stderr.getvalue() == ""


def test_a_warning_for_another_file_goes_to_the_showwarning_it_replaced(monkeypatch):
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *args: shown.append(args))
    console, elsewhere = terminal_console(), io.StringIO()

    def warn():
        warnings.showwarning("to a file", UserWarning, "x.py", 1, elsewhere)
        warnings.showwarning("to the terminal", UserWarning, "x.py", 2)

    sgd_trainer(callbacks=[Progress(console=console), During(warn)]).fit(make_batches(4), epochs=1)
    assert [args[0] for args in shown] == ["to a file"]
    printed = console.file.getvalue()
    assert "x.py:2: UserWarning: to the terminal" in printed and "to a file" not in printed


def test_off_a_terminal_nothing_is_rerouted_and_no_line_is_squeezed(monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    basic = logging.StreamHandler(tty)
    file = io.StringIO()
    console = Console(file=file)  # not a terminal: rich assumes 80 columns
    assert not console.is_terminal and console.width == 80
    library = logging.getLogger("a_library")
    monkeypatch.setattr(library, "handlers", [])
    talks = Talks(library)
    logging.root.addHandler(basic)
    try:
        trainer = flaxhooks.Trainer(Nested(), optax.sgd(0.1), loss_fn, callbacks=[
            Summary(console=console), Progress(console=console, every=flaxhooks.Every(steps=1)), talks])
        with pytest.warns(UserWarning, match="a Python warning"):  # left to Python's own machinery
            trainer.fit(batches(4, PER_DEVICE * len(trainer.devices), classes=3), epochs=1)
    finally:
        logging.root.removeHandler(basic)
    assert basic in talks.seen["root"]  # left where it was: it breaks no bar
    assert "a root warning" in tty.getvalue()
    lines = file.getvalue().splitlines()
    assert "\x1b" not in file.getvalue() and "\r" not in file.getvalue()
    assert re.match(r"done: step 4/4 .*\(step 4\)$", lines[-1])  # whole, however long
    table = [line for line in lines if line and line[0] in "┏┃┡│├└"]
    assert len({len(line) for line in table}) == 1 and len(table[0]) > 80
    assert "compiling the train step…" in lines
    assert any(line.startswith("train step compiled: first step done after") for line in lines)


def test_the_bar_fits_every_width_dropping_the_least_useful_fields_first():
    from tests.callbacks.test_progress import FakeClock, Tick, bar_frames

    for width in (30, 50, 80, 240):
        console, clock = terminal_console(width), FakeClock()
        trainer = sgd_trainer(callbacks=[Tick(clock, 0.3), Progress(console=console, clock=clock)])
        trainer.add(flaxhooks.Evaluate(make_arrays(32), every=flaxhooks.Every(steps=2), batch_size=16))
        trainer.fit(make_batches(4), epochs=2)
        frames = bar_frames(console)
        assert frames and all(len(frame) < width for frame in frames), (width, frames)
        last = frames[-1]
        assert "8/8" in last
        assert ("| eval loss" in last) == (width == 240)  # the evaluation goes first
        assert ("ETA" in last) == (width >= 80)
        assert ("loss" in last) == (width >= 50)
