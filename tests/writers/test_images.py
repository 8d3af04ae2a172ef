"""Images through the writers: the fan-out, and the TensorBoard event files."""

import io

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flaxhooks.writers import (
    AsyncWriter,
    TensorBoardWriter,
    Writer,
    Writers,
    truncate_events,
)


def png_of(pixels: np.ndarray) -> bytes:
    with io.BytesIO() as png:
        Image.fromarray(pixels).save(png, format="PNG")
        return png.getvalue()


def pixels_of(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


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
    png = png_of(pixels)
    grey = np.arange(8, dtype=np.uint8).reshape(2, 4)
    writer = AsyncWriter(TensorBoardWriter(str(tmp_path)))
    for step in (1, 2, 3):
        writer.images({"picture/png": png, "picture/grey": grey}, step)
        writer.images(lambda step=step: {"picture/pixels": np.full((2, 4, 4), step, np.uint8)}, step)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    written = events.Images("picture/png")
    assert [(e.step, e.height, e.width, e.encoded_image_string) for e in written] == [
        (step, 3, 5, png) for step in (1, 2, 3)]
    # Pixels are encoded as they are (RGBA kept; grey as RGB).
    for step, e in zip((1, 2, 3), events.Images("picture/pixels"), strict=True):
        assert (e.height, e.width) == (2, 4)
        np.testing.assert_array_equal(pixels_of(e.encoded_image_string), np.full((2, 4, 4), step))
    np.testing.assert_array_equal(pixels_of(events.Images("picture/grey")[0].encoded_image_string),
                                  np.repeat(grey[:, :, None], 3, axis=2))
    assert truncate_events(str(tmp_path), after_step=2) == 2
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Images("picture/png")] == [1, 2]


def test_what_is_not_an_image_is_refused_by_name(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    with pytest.raises(ValueError, match="uint8"):
        writer.images({"picture": np.zeros((2, 2, 3), np.float32)}, 1)
    with pytest.raises(ValueError, match="empty"):
        writer.images({"picture": np.zeros((0, 2, 3), np.uint8)}, 1)
    with pytest.raises(ValueError, match="not a PNG file"):
        writer.images({"picture": b"GIF89a"}, 1)
    writer.close()
