"""PNG files without an imaging library: what TensorBoard's Images tab
reads, and what a report saves."""

from __future__ import annotations

import struct
import zlib

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: PNG colour types by the number of channels (grey, grey and alpha, RGB, RGBA).
_COLOUR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(image: np.ndarray) -> bytes:
    """The PNG file of an 8-bit image: ``[H, W, 3]`` (RGB), ``[H, W, 4]``
    (RGBA), ``[H, W, 1]`` or ``[H, W]`` (grey).

    Examples:
        >>> import numpy as np
        >>> png = encode_png(np.zeros((2, 3, 3), np.uint8))
        >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n", png_size(png)
        (True, (2, 3))
    """
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in _COLOUR_TYPES:
        raise ValueError(f"a PNG is made of uint8 [H, W, 1|2|3|4] pixels, not {image.dtype} {image.shape}")
    height, width, channels = image.shape
    if not height or not width:
        raise ValueError(f"an image of {height}x{width} pixels is empty")
    # Each row starts with its filter type: 0, the bytes as they are.
    rows = np.zeros((height, 1 + width * channels), np.uint8)
    rows[:, 1:] = image.reshape(height, width * channels)
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOUR_TYPES[channels], 0, 0, 0)
    return b"".join([_SIGNATURE, _chunk(b"IHDR", header),
                     _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)), _chunk(b"IEND", b"")])


def png_size(png: bytes) -> tuple[int, int]:
    """``(height, width)`` of a PNG file, read from its header."""
    if png[:8] != _SIGNATURE or png[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", png[16:24])
    return height, width


def png_channels(png: bytes) -> int:
    """The number of channels of a PNG file: 1 grey, 2 grey and alpha, 3 RGB (or a palette), 4 RGBA."""
    if png[:8] != _SIGNATURE or png[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return {0: 1, 4: 2, 2: 3, 3: 3, 6: 4}.get(png[25], 3)
