"""The Progress callback: a rich bar on terminals, plain lines elsewhere, and
never a wait for unfinished metrics."""

import io
import re

import pytest
from rich.console import Console

import flaxhooks
from flaxhooks import Callback, CallbackError, Loop, Progress
from tests.helpers import HostReads, make_arrays, make_batches, sgd_trainer

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SHOW_CURSOR, HIDE_CURSOR = "\x1b[?25h", "\x1b[?25l"


class FakeClock:
    """Time that moves only when a test (or a Tick callback) moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Tick(Callback):
    """Moves a fake clock forward by ``seconds`` at every step."""

    order = -10

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def on_step_end(self, loop):
        self.clock.now += self.seconds


class _WatchedLoop(Loop):
    """A Loop whose ``metrics`` attribute reports reads while ``watching``."""

    watching = False
    reads = 0

    @property
    def metrics(self):
        if _WatchedLoop.watching:
            _WatchedLoop.reads += 1
        return Loop.metrics.fget(self)


class Watch(Callback):
    """Watches ``loop.metrics`` reads by the handlers that run between ``start``
    and ``stop`` (the callback under test, at the default order 0)."""

    def __init__(self, order, start):
        self.order = order
        self.start = start

    def _set(self, loop):
        if loop.__class__ is Loop:
            loop.__class__ = _WatchedLoop
        _WatchedLoop.watching = self.start


for _event in flaxhooks.EVENTS:
    setattr(Watch, f"on_{_event}", Watch._set)


def terminal():
    return Console(file=io.StringIO(), force_terminal=True, width=160)


def plain():
    return Console(file=io.StringIO(), force_terminal=False, width=80)


def text_of(console):
    return ANSI.sub("", console.file.getvalue())


def summary_of(console):
    """The summary at the end, its lines (broken between fields on a terminal) joined."""
    lines = text_of(console).rstrip().splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith(("done:", "stopped")))
    return "  ".join(line.strip() for line in lines[first:])


#: What a line or the summary says of where the time went (no MFU on CPUs: their peak is not known).
TIME_FIGURES = r"[\d,.]+ ex/s  data \d+%( \(input-bound\))?(  [\d.]+ [kMGTPE]?FLOP/s)?"


def bar_frames(console):
    """Every frame of the bar drawn on a terminal console, in order."""
    return [frame for frame in re.split(r"[\r\n]", text_of(console)) if frame.startswith("epoch ")]


def test_a_terminal_gets_a_bar_with_steps_epoch_rate_eta_and_loss():
    console, clock = terminal(), FakeClock()
    bar = Progress(console=console, clock=clock)
    sgd_trainer(callbacks=[Tick(clock, 0.3), bar]).fit(make_batches(4), epochs=3)
    out = console.file.getvalue()
    assert HIDE_CURSOR in out and out.rindex(SHOW_CURSOR) > out.rindex(HIDE_CURSOR)
    text = text_of(console)
    assert "epoch 3/3" in text
    assert re.search(r"\b12/12\b", text)
    assert re.search(r"\d+\.\d steps/s", text)
    assert "ETA" in text
    assert re.search(r"loss \d", text)
    summary = summary_of(console)
    assert summary.startswith("done: step 12/12  epoch")
    # Where the time went, over the whole fit; no MFU: the peak of a CPU is not known.
    assert re.search(rf"12 steps in \S+, \d+\.\d steps/s\)  {TIME_FIGURES}  loss", summary), summary
    assert "MFU" not in summary
    # The last step's own metrics, as off a terminal (the bar showed a settled step's, two behind).
    assert re.search(r"loss \S+ .*\(step 12\)", summary)


def test_the_bar_shows_evaluation_results():
    console, clock = terminal(), FakeClock()
    trainer = sgd_trainer(callbacks=[Tick(clock, 0.3), Progress(console=console, clock=clock)])
    trainer.add(flaxhooks.Evaluate(make_arrays(32), every=flaxhooks.Every(steps=4), batch_size=16))
    trainer.fit(make_batches(4), epochs=2)
    text = text_of(console)
    assert re.search(r"eval at step 4 \(32 examples\): loss \S+  accuracy", text)
    assert "| eval loss" in text


def test_plain_output_has_no_control_characters_and_periodic_lines():
    console, clock = plain(), FakeClock()
    every = flaxhooks.Every(seconds=1.0, clock=clock)
    sgd_trainer(callbacks=[Tick(clock, 0.25), Progress(console=console, every=every, clock=clock)]).fit(
        make_batches(4), epochs=3)
    out = console.file.getvalue()
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    # While XLA compiles, the first dispatch blocks: one line says so, one says when it ended.
    assert lines[:2] == ["compiling the train step…", "train step compiled: first step done after 0.2s"]
    periodic = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in periodic] == ["4/12", "8/12", "12/12"]
    for line in periodic:  # rates leave the compilation out
        # Then where the time of the steps since the last line went.
        assert re.search(rf"loss \S+ .*\(step \d+\)  4\.0 steps/s  ETA \d:\d\d:\d\d  {TIME_FIGURES}$",
                         line), line
    assert lines[-1].startswith("done: step 12/12  epoch")
    assert len(lines) == 6


def test_plain_lines_follow_a_step_schedule_and_are_never_wrapped():
    console = Console(file=io.StringIO(), force_terminal=False, width=20)
    bar = Progress(console=console, every=flaxhooks.Every(steps=3))
    sgd_trainer(callbacks=[bar]).fit(make_batches(4), steps=6)
    lines = console.file.getvalue().splitlines()
    assert [line.split()[1] for line in lines[2:4]] == ["3/6", "6/6"]
    assert len(lines) == 5 and "loss" in lines[-1]


@pytest.mark.parametrize("make_console", [terminal, plain])
def test_quiet_prints_only_the_summary(make_console):
    console, clock = make_console(), FakeClock()
    trainer = sgd_trainer(callbacks=[Tick(clock, 1.0), Progress(quiet=True, console=console, clock=clock)])
    trainer.add(flaxhooks.Evaluate(make_arrays(32), every=flaxhooks.Every(steps=2), batch_size=16))
    trainer.fit(make_batches(4), epochs=2)
    out = console.file.getvalue()
    assert HIDE_CURSOR not in out
    lines = text_of(console).splitlines()
    # One line, broken between fields on a terminal.
    assert lines[0].startswith("done: step 8/8") and all(line.startswith("  ") for line in lines[1:])
    summary = summary_of(console)
    assert "loss" in summary and "eval loss" in summary


def test_a_clock_that_never_moves_means_no_reads_during_the_steps(monkeypatch):
    reads, console = HostReads(monkeypatch), terminal()
    bar = Progress(console=console, clock=lambda: 0.0)
    sgd_trainer(callbacks=[reads, bar], if_nonfinite="off").fit(make_batches(4), epochs=3)
    assert reads.count == 0
    # The first refresh happens at the first step, before anything settled.
    assert "loss" not in bar_frames(console)[0]
    assert "loss" in summary_of(console)  # the summary, after fit_end


@pytest.mark.parametrize("make_console", [terminal, plain])
def test_reads_are_of_finished_steps_and_at_most_one_per_refresh(monkeypatch, make_console):
    reads, clock = HostReads(monkeypatch), FakeClock()
    every = flaxhooks.Every(seconds=0.25, clock=clock)
    bar = Progress(console=make_console(), every=every, clock=clock)  # refresh every 0.25 s
    sgd_trainer(callbacks=[reads, Tick(clock, 0.1), bar], if_nonfinite="off").fit(make_batches(4), epochs=5)
    # 20 steps of 0.1 s: at most 1 + 2.0 / 0.25 refreshes, one read per metric each.
    metrics = len(bar._metrics)
    assert metrics and 1 <= reads.count <= 9 * metrics
    assert reads.unready == 0


def test_the_bar_touches_loop_metrics_only_at_fit_end():
    _WatchedLoop.reads = 0
    clock = FakeClock()
    for console in (terminal(), plain()):
        every = flaxhooks.Every(steps=1)
        bar = Progress(console=console, every=every, clock=clock)
        trainer = sgd_trainer(callbacks=[Tick(clock, 1.0), Watch(-1, True), bar, Watch(1, False)])
        trainer.add(flaxhooks.Evaluate(make_arrays(32), every=flaxhooks.Every(steps=2), batch_size=16))
        trainer.fit(make_batches(4), epochs=2)
        assert "loss" in text_of(console) and "eval at step 2 (32 examples)" in text_of(console)
    assert "\x1b" not in console.file.getvalue()  # the plain one
    _WatchedLoop.watching = False
    assert _WatchedLoop.reads == 2  # once per fit, at its end: the last step's metrics
    # The watch itself works: ConsoleLog reads loop.metrics when due.
    log = flaxhooks.ConsoleLog(flaxhooks.Every(steps=1), stream=io.StringIO())
    sgd_trainer(callbacks=[Watch(-1, True), log, Watch(1, False)]).fit(make_batches(4), epochs=1)
    _WatchedLoop.watching = False
    assert _WatchedLoop.reads > 0


class Boom(Callback):
    def __init__(self, error):
        self.error = error

    def on_step_end(self, loop):
        if loop.step == 5:
            raise self.error


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_the_bar_is_stopped_at_fit_end_after_an_error(error):
    import sys

    stdout = sys.stdout
    console, clock = terminal(), FakeClock()
    trainer = sgd_trainer(callbacks=[Tick(clock, 1.0), Boom(error), Progress(console=console, clock=clock)])
    with pytest.raises(CallbackError if isinstance(error, Exception) else KeyboardInterrupt):
        trainer.fit(make_batches(4), epochs=3)
    assert sys.stdout is stdout  # the Live display's redirection is undone
    assert console._live_stack == []
    out = console.file.getvalue()
    assert out.rindex(SHOW_CURSOR) > out.rindex(HIDE_CURSOR)
    summary = summary_of(console)
    name = type(error).__name__ if isinstance(error, KeyboardInterrupt) else "CallbackError"
    assert summary.startswith(f"stopped by {name} at step 5/12  epoch 2/3")
    assert "loss" in summary


def test_a_resumed_fit_starts_the_bar_at_the_state_step():
    trainer = sgd_trainer()
    trainer.fit(make_batches(4), steps=3)
    console, clock = terminal(), FakeClock()

    class Seen(Callback):
        order = 1  # after the bar's refresh

        def __init__(self):
            self.tasks = []

        def on_step_end(self, loop):
            task = bar._bar.tasks[0]
            self.tasks.append((task.completed, task.total))

    bar = Progress(console=console, clock=clock)
    seen = Seen()
    trainer.add(Tick(clock, 1.0), bar, seen)
    trainer.fit(make_batches(4), steps=6)
    assert seen.tasks == [(4, 6), (5, 6), (6, 6)]
    text = text_of(console)
    # The bar appears once the first step (compiling) is done: step 4 of the resumed fit.
    assert re.search(r"\b4/6\b", bar_frames(console)[0])
    assert "done: step 6/6" in text and "(3 steps in" in text


@pytest.mark.parametrize(("fit", "total"), [
    ({"epochs": 2}, "8"),            # epochs x steps per epoch
    ({"steps": 6, "epochs": 5}, "6"),  # the smaller of the two
])
def test_the_total_comes_from_steps_or_epochs(fit, total):
    console = terminal()
    sgd_trainer(callbacks=[Progress(console=console, clock=lambda: 0.0)]).fit(make_batches(4), **fit)
    frames = bar_frames(console)
    assert re.search(rf"\b1/{total}\b", frames[0]) and re.search(rf"\b{total}/{total}\b", frames[-1])


def test_data_without_a_length_gives_an_indeterminate_bar():
    console, clock = terminal(), FakeClock()
    batches = make_batches(4)
    sgd_trainer(callbacks=[Tick(clock, 1.0), Progress(console=console, clock=clock)]).fit(
        lambda epoch: iter(batches), epochs=2)
    text = text_of(console)
    assert re.search(r"\b8/\?", text)
    assert "done: step 8  epoch 2/2" in text


def test_refresh_per_second_must_be_positive():
    with pytest.raises(ValueError, match="refresh_per_second"):
        Progress(refresh_per_second=0)


def test_the_last_frame_shows_the_final_count_even_without_a_refresh():
    console, clock = terminal(), FakeClock()  # the clock never moves: no timed refresh
    sgd_trainer(callbacks=[Progress(console=console, clock=clock)]).fit(make_batches(3), epochs=1)
    frames = text_of(console).rstrip().splitlines()
    assert re.search(r"\b3/3\b", frames[-2])  # the bar's last frame, above the summary line
