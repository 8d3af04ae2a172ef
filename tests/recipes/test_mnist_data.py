"""Tests for recipes/mnist_data.py: all offline, against a local HTTP server."""

from __future__ import annotations

import gzip
import hashlib
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from recipes import mnist_data as md

NAMES = [f.name for f in md.MNIST_FILES]


def _idx_gz(array: np.ndarray) -> bytes:
    """Encode an array as gzipped IDX, written independently of the code under test."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    return gzip.compress(header + array.astype(array.dtype.newbyteorder(">")).tobytes())


def _flip_byte(blob: bytes, index: int = -1) -> bytes:
    corrupt = bytearray(blob)
    corrupt[index] ^= 0xFF
    return bytes(corrupt)


@dataclass
class Fixture:
    arrays: list[np.ndarray]  # train images, train labels, test images, test labels
    blobs: dict[str, bytes]
    files: tuple[md.RemoteFile, ...]


@pytest.fixture(scope="module")
def fx() -> Fixture:
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 12).astype(np.uint8),
        rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 5).astype(np.uint8),
    ]
    blobs = {name: _idx_gz(a) for name, a in zip(NAMES, arrays, strict=False)}
    files = tuple(
        md.RemoteFile(name, len(b), hashlib.sha256(b).hexdigest()) for name, b in blobs.items()
    )
    return Fixture(arrays, blobs, files)


class Server:
    """Serves ``routes[path] = (body, mode)`` and records every requested path.

    Modes: ``ok``; ``short`` sends a full Content-Length but only half the body;
    ``short-no-length`` sends half the body with no Content-Length; ``drop``
    closes the connection without a response.
    """

    def __init__(self) -> None:
        self.routes: dict[str, tuple[bytes, str]] = {}
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if self.path not in outer.routes:
                    self.send_error(404)
                    return
                body, mode = outer.routes[self.path]
                if mode == "drop":
                    return
                self.send_response(200)
                if mode != "short-no-length":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body if mode == "ok" else body[: len(body) // 2])

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()

    def url(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{prefix}/"

    def serve(self, prefix: str, blobs: dict[str, bytes], mode: str = "ok") -> str:
        for name, body in blobs.items():
            self.routes[f"/{prefix}/{name}"] = (body, mode)
        return self.url(prefix)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def closed_url() -> str:
    """A URL on a local port nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/mnist/"


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _assert_sample(data: md.MnistData) -> None:
    assert data.source == "sample"
    assert data.train_images.shape == (4000, 28, 28)
    assert data.test_images.shape == (1000, 28, 28)


# --- read_idx ---------------------------------------------------------------


def test_read_idx_roundtrip(tmp_path: Path) -> None:
    images = np.arange(2 * 28 * 28, dtype=np.uint32).reshape(2, 28, 28).astype(np.uint8)
    values = np.array([[1, -2, 70000], [0, 2**31 - 1, -(2**31)]], dtype=np.int32)
    for name, array in (("u8.gz", images), ("i32.gz", values)):
        (tmp_path / name).write_bytes(_idx_gz(array))
        got = md.read_idx(tmp_path / name)
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize(
    "payload",
    [
        gzip.compress(b"\x01\x00\x08\x01" + struct.pack(">I", 3) + b"abc"),  # bad magic
        gzip.compress(b"\x00\x00\x07\x01" + struct.pack(">I", 3) + b"abc"),  # unknown type
        gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 4) + b"abc"),  # too few bytes
        gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"abc"),  # too many bytes
        gzip.compress(b"\x00\x00\x08\x02" + struct.pack(">I", 3)),  # header cut short
        gzip.compress(b"\x00\x00"),
        b"\x00\x00\x08\x01" + struct.pack(">I", 3) + b"abc",  # not gzipped
        gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 3) + b"abc")[:-6],  # cut gzip
        # Bit rot in the first deflate byte: zlib itself fails, not just the CRC.
        _flip_byte(gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 3) + b"abc"), 10),
    ],
    # Named by place: the payloads' gzip headers hold the time they were made.
    ids=["bad-magic", "unknown-type", "too-few-bytes", "too-many-bytes", "header-cut-short", "no-header",
         "not-gzipped", "cut-gzip", "bit-rot"],
)
def test_read_idx_rejects_malformed(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / "bad.gz").write_bytes(payload)
    with pytest.raises(ValueError):
        md.read_idx(tmp_path / "bad.gz")


# --- fetch / load_mnist with full files ---------------------------------------


def test_download_verify_and_cache(tmp_path: Path, fx: Fixture, server: Server) -> None:
    mirror = server.serve("mnist", fx.blobs)
    cache = tmp_path / "cache"

    paths = md.fetch(fx.files, cache_dir=cache, mirrors=(mirror,))

    assert paths == {name: cache / name for name in NAMES}
    assert _listing(cache) == sorted(NAMES)  # no temporary files left over
    for name, blob in fx.blobs.items():
        got = paths[name].read_bytes()
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(blob).hexdigest()
    assert sorted(server.requests) == sorted(f"/mnist/{n}" for n in NAMES)

    data = md.load_mnist(cache_dir=cache, mirrors=(mirror,), files=fx.files)
    assert len(server.requests) == 4  # the second load came from the cache
    assert data.source == "full"
    for got, want in zip(
        (data.train_images, data.train_labels, data.test_images, data.test_labels), fx.arrays, strict=False
    ):
        np.testing.assert_array_equal(got, want)
    assert data.train_images.dtype == np.uint8 and data.train_labels.dtype == np.int32
    assert data.test_images.dtype == np.uint8 and data.test_labels.dtype == np.int32


@pytest.mark.parametrize(
    ("transform", "mode", "reason"),
    [
        (_flip_byte, "ok", "sha256"),  # right size, wrong content
        (lambda b: b + b"extra", "ok", "bytes"),  # too long
        (lambda b: b[:-10], "ok", "bytes"),  # too short, consistently served
        (lambda b: b, "short", "bytes"),  # connection closed before Content-Length bytes
        (lambda b: b, "short-no-length", "bytes"),  # connection closed, no length given
    ],
)
def test_bad_download_is_not_used_nor_left_behind(
    tmp_path: Path, fx: Fixture, server: Server, transform, mode: str, reason: str, caplog
) -> None:
    bad = NAMES[0]
    mirror = server.serve("mnist", {**fx.blobs, bad: transform(fx.blobs[bad])}, mode)
    cache = tmp_path / "cache"

    with pytest.raises(md.MnistUnavailable, match=reason) as err:
        md.fetch(fx.files, cache_dir=cache, mirrors=(mirror,))
    assert bad in str(err.value) and "\n" not in str(err.value)
    assert _listing(cache) == []

    with caplog.at_level(logging.WARNING, logger=md.__name__):
        data = md.load_mnist(cache_dir=cache, mirrors=(mirror,), files=fx.files)
    _assert_sample(data)
    assert _listing(cache) == []
    assert [r.getMessage() for r in caplog.records] == [data.note]


def test_data_dir_is_used_without_network(tmp_path: Path, fx: Fixture, server: Server) -> None:
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    data_dir.mkdir()
    for name, blob in fx.blobs.items():
        (data_dir / name).write_bytes(blob)

    data = md.load_mnist(data_dir, cache, mirrors=(server.url("mnist"),), files=fx.files)

    assert data.source == "full"
    np.testing.assert_array_equal(data.test_images, fx.arrays[2])
    assert server.requests == []
    assert _listing(cache) == []


def test_corrupt_data_dir_file_is_not_used_nor_deleted(
    tmp_path: Path, fx: Fixture, server: Server, caplog
) -> None:
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    data_dir.mkdir()
    for name, blob in fx.blobs.items():
        (data_dir / name).write_bytes(blob)
    bad = NAMES[1]
    corrupt = _flip_byte(fx.blobs[bad])
    (data_dir / bad).write_bytes(corrupt)

    with pytest.raises(md.MnistUnavailable, match="sha256"):
        md.fetch(fx.files, data_dir=data_dir, cache_dir=cache, download=False)

    mirror = server.serve("mnist", fx.blobs)
    with caplog.at_level(logging.WARNING, logger=md.__name__):
        paths = md.fetch(fx.files, data_dir=data_dir, cache_dir=cache, mirrors=(mirror,))

    assert paths == {name: (cache if name == bad else data_dir) / name for name in NAMES}
    assert (cache / bad).read_bytes() == fx.blobs[bad]
    assert (data_dir / bad).read_bytes() == corrupt
    assert server.requests == [f"/mnist/{bad}"]
    assert len(caplog.records) == 1 and str(data_dir / bad) in caplog.records[0].getMessage()


def test_corrupt_cache_file_is_replaced(tmp_path: Path, fx: Fixture, server: Server) -> None:
    mirror = server.serve("mnist", fx.blobs)
    cache = tmp_path / "cache"
    md.fetch(fx.files, cache_dir=cache, mirrors=(mirror,))
    bad = NAMES[2]
    (cache / bad).write_bytes(_flip_byte(fx.blobs[bad]))
    server.requests.clear()

    md.fetch(fx.files, cache_dir=cache, mirrors=(mirror,))

    assert server.requests == [f"/mnist/{bad}"]
    assert (cache / bad).read_bytes() == fx.blobs[bad]
    assert _listing(cache) == sorted(NAMES)


def test_mirrors_are_tried_in_order(
    tmp_path: Path, fx: Fixture, server: Server, closed_url: str
) -> None:
    good = server.serve("good", fx.blobs)
    dropping = server.serve("drop", fx.blobs, "drop")
    missing = server.url("missing")  # every file 404s
    cache = tmp_path / "cache"

    paths = md.fetch(fx.files, cache_dir=cache, mirrors=(closed_url, dropping, missing, good))

    assert all(paths[n].read_bytes() == fx.blobs[n] for n in NAMES)
    # A mirror whose connection failed is not tried again for later files; one
    # that answered 404 is.
    assert server.requests == [f"/drop/{NAMES[0]}"] + [
        p for n in NAMES for p in (f"/missing/{n}", f"/good/{n}")
    ]


def test_no_mirrors_and_no_files(tmp_path: Path, fx: Fixture) -> None:
    with pytest.raises(md.MnistUnavailable, match="no mirrors"):
        md.fetch(fx.files, cache_dir=tmp_path, mirrors=())
    with pytest.raises(md.MnistUnavailable, match="download=False"):
        md.fetch(fx.files, cache_dir=tmp_path, download=False)


# --- the bundled sample and the fallback --------------------------------------


def test_bundled_files_match_their_table() -> None:
    for spec in md.SAMPLE_FILES:
        blob = (Path(md.__file__).parent / "data" / spec.name).read_bytes()
        assert (len(blob), hashlib.sha256(blob).hexdigest()) == (spec.size, spec.sha256)


def test_bundled_sample_split() -> None:
    data_dir = Path(md.__file__).parent / "data"
    # Reference: parse the files by hand (IDX headers are 16 and 8 bytes here).
    images = np.frombuffer(
        gzip.decompress((data_dir / "mnist5k-images-idx3-ubyte.gz").read_bytes())[16:], np.uint8
    ).reshape(5000, 28, 28)
    labels = np.frombuffer(
        gzip.decompress((data_dir / "mnist5k-labels-idx1-ubyte.gz").read_bytes())[8:], np.uint8
    )
    assert np.bincount(labels, minlength=10).tolist() == [500] * 10
    train_idx = np.sort(np.concatenate([np.flatnonzero(labels == d)[:400] for d in range(10)]))
    test_idx = np.sort(np.concatenate([np.flatnonzero(labels == d)[400:] for d in range(10)]))

    data = md.load_bundled_sample()

    _assert_sample(data)
    assert (data.train_labels.dtype, data.test_labels.dtype) == (np.int32, np.int32)
    assert (data.train_images.dtype, data.test_images.dtype) == (np.uint8, np.uint8)
    np.testing.assert_array_equal(data.train_images, images[train_idx])
    np.testing.assert_array_equal(data.train_labels, labels[train_idx])
    np.testing.assert_array_equal(data.test_images, images[test_idx])
    np.testing.assert_array_equal(data.test_labels, labels[test_idx])
    assert np.bincount(data.train_labels).tolist() == [400] * 10
    assert np.bincount(data.test_labels).tolist() == [100] * 10
    # Disjoint: no held-out image also appears in train (all 5,000 are distinct).
    train_rows = {img.tobytes() for img in data.train_images}
    assert not any(img.tobytes() in train_rows for img in data.test_images)
    assert len(train_rows) == 4000

    again = md.load_bundled_sample()
    np.testing.assert_array_equal(again.train_images, data.train_images)
    np.testing.assert_array_equal(again.test_labels, data.test_labels)


def test_unreachable_mirror_falls_back_fast_in_one_line(
    tmp_path: Path, fx: Fixture, closed_url: str, caplog
) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=md.__name__):
        data = md.load_mnist(cache_dir=tmp_path / "cache", mirrors=(closed_url,), files=fx.files)
    elapsed = time.monotonic() - start

    _assert_sample(data)
    assert elapsed < 3
    assert [r.getMessage() for r in caplog.records] == [data.note]
    # One short line a person reads at a glance; every detail in the debug log.
    assert data.note == "full MNIST unavailable (cannot reach 127.0.0.1); using the bundled sample"
    assert _listing(tmp_path / "cache") == []


def test_no_network_is_said_in_those_words_and_the_details_go_to_the_debug_log(
    tmp_path: Path, fx: Fixture, caplog
) -> None:
    mirror = "http://mnist.invalid/"  # .invalid never resolves (RFC 2606)
    with caplog.at_level(logging.DEBUG, logger=md.__name__):
        data = md.load_mnist(cache_dir=tmp_path / "cache", mirrors=(mirror,), files=fx.files)
    _assert_sample(data)
    assert data.note == "full MNIST unavailable (no network); using the bundled sample"
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and "mnist.invalid" in debug[0] and "gaierror" in debug[0]


def test_download_false_falls_back(tmp_path: Path, fx: Fixture) -> None:
    data = md.load_mnist(tmp_path, tmp_path, download=False, files=fx.files)
    _assert_sample(data)
    assert "(not found locally, and downloading is off)" in data.note


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLAXHOOKS_CACHE", str(tmp_path / "fh"))
    assert md.default_cache_dir() == tmp_path / "fh"
    monkeypatch.delenv("FLAXHOOKS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert md.default_cache_dir() == tmp_path / "xdg" / "flaxhooks" / "mnist"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert md.default_cache_dir() == tmp_path / "home" / ".cache" / "flaxhooks" / "mnist"
