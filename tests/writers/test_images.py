"""Images through the writers: the fan-out, and the TensorBoard event files."""

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flaxhooks.writers import (
    AsyncWriter,
    TensorBoardWriter,
    Writer,
    Writers,
    encode_png,
    png_size,
    truncate_events,
)


class Recording(Writer):
    def __init__(self):
        self.written = []

    def images(self, values, step):
        self.written.append((step, dict(values() if callable(values) else values)))


class NoImages(Writer):
    """A writer of its own that writes no images: the base class leaves them out."""

    def text(self, tag, text, step=0):
        pass


def test_images_go_to_every_writer_that_writes_them_and_a_function_is_called_once():
    calls = []

    def pictures():
        calls.append(1)
        return {"picture": b"png"}

    first, second = Recording(), Recording()
    Writers([first, NoImages(), second]).images(pictures, step=3)
    assert first.written == second.written == [(3, {"picture": b"png"})]
    assert calls == [1]
    Writers().images(pictures, step=4)  # nowhere to go: not even called
    assert calls == [1]


def test_images_are_image_summaries_that_a_resumed_run_drops_after_its_step(tmp_path):
    pixels = np.zeros((3, 5, 3), np.uint8)
    pixels[1, 2] = (255, 0, 0)
    png = encode_png(pixels)
    writer = AsyncWriter(TensorBoardWriter(str(tmp_path)))
    for step in (1, 2, 3):
        writer.images({"picture/png": png}, step)
        writer.images(lambda step=step: {"picture/pixels": np.full((2, 4, 3), step, np.uint8)}, step)
    writer.close()
    assert png_size(png) == (3, 5)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    written = events.Images("picture/png")
    assert [(e.step, e.height, e.width, e.encoded_image_string) for e in written] == [
        (step, 3, 5, png) for step in (1, 2, 3)]
    assert [e.encoded_image_string for e in events.Images("picture/pixels")] == [
        encode_png(np.full((2, 4, 3), step, np.uint8)) for step in (1, 2, 3)]
    assert truncate_events(str(tmp_path), after_step=2) == 2
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Images("picture/png")] == [1, 2]
