"""Writers: a service on the loop that callbacks write through (scalars,
text, histograms, images, a sync point before a checkpoint commits), and the
TensorBoard event files behind it."""

from flaxhooks.writers._files import (
    LogdirError,
    SummaryWriterThread,
    check_writable,
    read_layout,
    truncate_events,
)
from flaxhooks.writers._png import encode_png, png_size
from flaxhooks.writers._service import Histogram, Images, Values, Writer, WriterCallback, Writers

__all__ = [
    "Histogram",
    "Images",
    "LogdirError",
    "SummaryWriterThread",
    "Values",
    "Writer",
    "WriterCallback",
    "Writers",
    "check_writable",
    "encode_png",
    "png_size",
    "read_layout",
    "truncate_events",
]
