"""The writer layers: a backend, the async wrapper around any writer, the fan-out."""

import threading

import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks.writers
from flaxhooks.writers import AsyncWriter, TensorBoardWriter, Writer, Writers


class Kept(Writer):
    """A synchronous writer of its own that keeps what it is given, on whichever thread."""

    def __init__(self, fail_at: int | None = None):
        self.written: list[tuple[str, int, dict]] = []
        self.threads: set[str] = set()
        self.flushed = self.closed = 0
        self.fail_at = fail_at

    def scalars(self, values, step, prefix="", run=""):
        self.threads.add(threading.current_thread().name)
        if step == self.fail_at:
            raise OSError(28, "No space left on device")
        values = values() if callable(values) else values
        self.written.append((run, step, {prefix + k: float(v) for k, v in values.items()}))

    def text(self, tag, text, step=0):
        pass

    def charts(self, category, charts, step):
        pass

    def histograms(self, values, step):
        pass

    def sync_point(self):
        done = threading.Event()
        done.set()
        return done

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed += 1


def test_the_async_wrapper_writes_any_writer_in_order_off_the_calling_thread():
    kept = Kept()
    writer = AsyncWriter(kept)
    writer.step_scalars({"loss": jnp.float32(1.5), "rate": 3.0}, 1, run="train")
    writer.scalars({"x": jnp.float32(2.0)}, 2, prefix="a/")
    writer.step_scalars({"loss": jnp.float32(0.5)}, 3, run="train")
    assert writer.flush(timeout=60)
    writer.close()
    assert kept.written == [("train", 1, {"loss": 1.5, "rate": 3.0}), ("", 2, {"a/x": 2.0}),
                            ("train", 3, {"loss": 0.5})]
    assert kept.threads == {"flaxhooks-writer"} and kept.flushed >= 1 and kept.closed == 1


def test_a_failure_on_the_thread_is_raised_by_the_next_call_once():
    writer = AsyncWriter(Kept(fail_at=2))
    writer.scalars({"x": 1.0}, 2)
    writer.sync_point().wait(60)
    with pytest.raises(RuntimeError, match="No space left on device"):
        writer.scalars({"x": 1.0}, 3)
    writer.scalars({"x": 1.0}, 4)  # raised once
    assert writer.close(timeout=60)


def test_the_fan_out_gives_step_scalars_to_a_writer_without_them_as_scalars():
    kept = Kept()
    assert isinstance(TensorBoardWriter("unused"), Writer)
    writers = Writers([kept])
    writers.step_scalars({"loss": 0.25}, 7, run="train")
    writers.flush()
    assert kept.written == [("train", 7, {"loss": 0.25})] and kept.flushed == 1


def test_the_tensorboard_backend_writes_at_once_and_the_old_name_warns(tmp_path):
    files = TensorBoardWriter(str(tmp_path))
    files.step_scalars({"loss": jnp.float32(0.5)}, 1, run="train")
    files.scalars(lambda: {"x": 2.0}, 1)
    files.flush()  # on disk without a close
    assert [e.value for e in _read(tmp_path / "train").Scalars("loss")] == [0.5]
    assert [e.value for e in _read(tmp_path).Scalars("x")] == [2.0]
    files.close()
    with pytest.warns(DeprecationWarning, match="AsyncWriter"):
        old = flaxhooks.writers.SummaryWriterThread
    writer = old(str(tmp_path))
    assert isinstance(writer, AsyncWriter) and writer.close()


def _read(logdir) -> EventAccumulator:
    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_a_writer_of_07s_shape_still_writes_with_a_deprecation_warning():
    """An object with 0.7's writer methods that does not subclass Writer is
    adapted with a warning naming the base class, until 0.9: its optional
    methods found by name, the rest falling back as the base class does."""

    class Plain:  # Kept's required methods, not a Writer subclass, no flush, runs or images
        __init__, scalars, text, charts = Kept.__init__, Kept.scalars, Kept.text, Kept.charts
        histograms, sync_point = Kept.histograms, Kept.sync_point

    plain = Plain()
    with pytest.warns(DeprecationWarning, match=r"Plain .* flaxhooks\.writers\.Writer; subclass it"):
        writers = Writers([plain])
    writers.step_scalars({"loss": 1.5}, 3)
    writers.run_scalars({"train": {"loss": 2.0}}, 4)  # no runs of its own: the run goes into the tag
    writers.images({"x": b""}, 4)  # none: left out
    writers.flush()
    assert plain.written == [("", 3, {"loss": 1.5}), ("", 4, {"train/loss": 2.0})]
    assert writers.sync_point().wait(0)
