"""Releases as single files: uncompressed tar archives of release directories, written in a
fixed order and read back with every safety check an archive from a stranger needs.

A dock stores each learnware's spec and model release as such an archive (so a download is the
developer's exact bytes, with its content hash), and a submission over HTTP is one archive
holding ``submission.json``, ``spec/`` and optionally ``model/``.

:func:`extract` accepts only regular files and directories with relative names under the
allowed top-level entries (no links, devices, absolute paths or ``..``), caps the number of
members and the extracted size, and reports a truncated or corrupted archive as
:class:`ArchiveError` (never a partial directory: it extracts into a new directory that the
caller removes on failure).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

__all__ = ["ArchiveError", "extract", "file_sha256", "pack", "release_files"]

MAX_MEMBERS = 10_000
_RELEASE_TOP = {"tensors", "metadata.json", "CONTENT_HASH"}


class ArchiveError(ValueError):
    """The archive is malformed, truncated, too large or holds something it may not."""


def release_files(root: Path) -> list[str]:
    """The relative paths of a release directory's files, sorted; refuses links and anything
    outside the release layout (``tensors/``, ``metadata.json``, ``CONTENT_HASH``)."""
    root = Path(root)
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            raise ArchiveError(f"{rel} is a link; a release holds plain files only")
        if PurePosixPath(rel).parts[0] not in _RELEASE_TOP:
            raise ArchiveError(f"{rel} is not part of a release (a release holds tensors/, "
                               f"metadata.json and CONTENT_HASH only)")
        if p.is_file():
            out.append(rel)
        elif not p.is_dir():
            raise ArchiveError(f"{rel} is not a regular file")
    return sorted(out)


def pack(out: BinaryIO, dirs: Iterable[tuple[str, Path]],
         files: Iterable[tuple[str, bytes]] = ()) -> None:
    """Write an uncompressed tar to ``out``: each ``(name, release_dir)`` under ``name/`` (its
    files in sorted order), then each ``(name, bytes)`` as a file. Owners and times are zeroed,
    so one release always packs to the same bytes."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, root in dirs:
            for rel in release_files(root):
                _add(tar, f"{name}/{rel}", (Path(root) / rel).read_bytes())
        for name, data in files:
            _add(tar, name, data)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def extract(archive: Any, dest: Path, *, allowed_top: set[str], max_bytes: int) -> None:
    """Extract ``archive`` (a path, or any path object with ``open``, e.g. an
    ``etils.epath.Path``) into the new directory ``dest`` after checking every member (see the
    module docstring). Raises :class:`ArchiveError` saying what is wrong."""
    dest = Path(dest)
    dest.mkdir()
    total = 0
    opener = archive.open if hasattr(archive, "open") else Path(archive).open
    try:
        with opener("rb") as fh, tarfile.open(fileobj=fh, mode="r:") as tar:
            members = []
            for m in tar:
                if len(members) >= MAX_MEMBERS:
                    raise ArchiveError(f"the archive holds more than {MAX_MEMBERS} entries")
                path = PurePosixPath(m.name)
                if path.is_absolute() or ".." in path.parts or not path.parts:
                    raise ArchiveError(f"archive entry {m.name!r} has an unsafe path")
                if path.parts[0] not in allowed_top:
                    raise ArchiveError(f"unexpected archive entry {m.name!r}; allowed at the top: "
                                       f"{sorted(allowed_top)}")
                if not (m.isfile() or m.isdir()):
                    raise ArchiveError(f"archive entry {m.name!r} is not a regular file or "
                                       f"directory (links and devices are refused)")
                total += m.size
                if total > max_bytes:
                    raise ArchiveError(f"the archive unpacks to more than {max_bytes} bytes")
                members.append(m)
            for m in members:
                target = dest / m.name
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                if src is None:
                    raise ArchiveError(f"archive entry {m.name!r} cannot be read")
                with src, open(target, "wb") as f:
                    remaining = m.size
                    while remaining:
                        chunk = src.read(min(remaining, 1 << 20))
                        if not chunk:
                            raise ArchiveError(f"the archive is truncated inside {m.name!r}")
                        f.write(chunk)
                        remaining -= len(chunk)
    except (tarfile.TarError, EOFError) as e:
        raise ArchiveError(f"the upload is not a readable tar archive (truncated or "
                           f"corrupted?): {e}") from None


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
