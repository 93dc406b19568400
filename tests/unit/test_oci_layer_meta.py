"""The staging size of a downloaded tar layer, read from the layer file itself."""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path

import zstandard

from preheat.sources.oci_layer_meta import unpacked_size

MiB = 1 << 20


def _write(path: Path, data: bytes) -> int:
    path.write_bytes(data)
    return len(data)


def test_gzip_size_comes_from_the_trailer_even_when_it_does_not_compress(tmp_path: Path) -> None:
    """Random bytes grow a little under gzip: the ISIZE trailer is still taken as it is,
    and zeros that shrink 1000x are still counted in full."""
    rnd, zeros = tmp_path / "rnd.gz", tmp_path / "zeros.gz"
    n = _write(rnd, gzip.compress(os.urandom(MiB)))
    assert n > MiB and unpacked_size(rnd, "gzip", n) == MiB
    n = _write(zeros, gzip.compress(bytes(4 * MiB)))
    assert n < MiB and unpacked_size(zeros, "gzip", n) == 4 * MiB


def test_zstd_size_from_the_frame_header_or_counted(tmp_path: Path) -> None:
    """A frame with its content size answers from the header; a streamed one (no content
    size) is decompressed and counted."""
    data = bytes(3 * MiB)
    framed = tmp_path / "framed.zst"
    n = _write(framed, zstandard.ZstdCompressor().compress(data))
    assert unpacked_size(framed, "zstd", n) == 3 * MiB
    buf = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as w:
        w.write(data)
    streamed = tmp_path / "streamed.zst"
    n = _write(streamed, buf.getvalue())
    assert zstandard.frame_content_size(buf.getvalue()[:18]) == -1
    assert unpacked_size(streamed, "zstd", n) == 3 * MiB


def test_a_plain_tar_stages_its_own_size(tmp_path: Path) -> None:
    """An uncompressed layer unpacks to no more than itself."""
    plain = tmp_path / "l.tar"
    n = _write(plain, b"x" * 10_240)
    assert unpacked_size(plain, "", n) == n


def test_zstd_size_sums_every_frame_and_skips_skippable_ones(tmp_path: Path) -> None:
    """Frames with checksums, random (raw blocks) and zeros (RLE blocks), with a skippable
    frame between them, sum to their contents from the headers alone; with a last frame
    that declares no size, the whole stream is counted."""
    rnd = os.urandom(300 << 10)
    checked = zstandard.ZstdCompressor(write_checksum=True)
    skip = (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"xxxxx"
    stream = checked.compress(rnd) + skip + zstandard.ZstdCompressor().compress(bytes(2 * MiB))
    whole = tmp_path / "frames.zst"
    n = _write(whole, stream)
    assert unpacked_size(whole, "zstd", n) == len(rnd) + 2 * MiB
    co = zstandard.ZstdCompressor().compressobj()  # streamed: declares no size
    mixed = tmp_path / "mixed.zst"
    n = _write(mixed, stream + co.compress(bytes(MiB)) + co.flush())
    assert unpacked_size(mixed, "zstd", n) == len(rnd) + 3 * MiB


def test_gzip_members_are_counted_when_the_last_trailer_is_too_small(tmp_path: Path) -> None:
    """Two gzip members, the last one random and small: its ISIZE is below the compressed
    size, so every member is counted (not the last trailer's 100 KiB, nor 4 GiB more)."""
    rnd = os.urandom(600 << 10)
    data = gzip.compress(bytes(2 * MiB) + rnd[: 500 << 10]) + gzip.compress(rnd[500 << 10 :])
    path = tmp_path / "members.gz"
    n = _write(path, data)
    assert unpacked_size(path, "gzip", n) == 2 * MiB + len(rnd)
