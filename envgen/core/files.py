"""Files read within bounds and written atomically: a device, a FIFO or a file of gigabytes is refused before it is
read, and a crash or an interrupt never leaves a half-written file where a reader expects a whole one (nor, on the
next run, its temporary files or a folder moved aside)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


class InputFileError(ValueError):
    """A file that cannot be read as asked: missing, not a regular file, too large, not UTF-8 or not the JSON asked
    for; the message names the file and the fix."""


def read_bytes_bounded(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them: a FIFO, a device (``/dev/zero``) or a folder
    is refused before it is opened (reading one would hang or never end), and a file longer than ``limit`` is refused
    after ``limit + 1`` bytes, whatever its size claims."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{path}: not a regular file (a folder, device or FIFO); give the path of a {what}")
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InputFileError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > limit:
        raise InputFileError(f"{path}: larger than {limit:,} bytes; a {what} is at most that")
    return data


def read_text_bounded(path: str | Path, limit: int, what: str = "file") -> str:
    """:func:`read_bytes_bounded` as UTF-8 text."""
    data = read_bytes_bounded(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{path}: not UTF-8 text (byte {e.start}); save the {what} as UTF-8") from None


MAX_JSON_BYTES = 64_000_000
"""Largest JSON input read (metrics, summaries, references: kilobytes to a few megabytes)."""


def read_json(path: str | Path, what: str = "JSON file", limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of ``path`` within bounds: too large, nested too deep, not JSON: one :class:`InputFileError`."""
    text = read_text_bounded(path, limit, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{path}: not JSON (line {e.lineno}: {e.msg}); give the {what}") from None
    except RecursionError:
        raise InputFileError(f"{path}: JSON nested too deep to read; give the {what}") from None


def expect_mapping(value: Any, path: str | Path, what: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` if it is a JSON object holding ``keys``, else an :class:`InputFileError` naming the file."""
    if not isinstance(value, dict):
        raise InputFileError(f"{path}: expected a JSON object ({what}), got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise InputFileError(f"{path}: no {', '.join(repr(k) for k in missing)} in it; is it the {what}?")
    return value


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and an atomic rename; temporary files that an
    interrupted write left beside ``path`` (:data:`STALE_TMP_SECONDS` old) are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the permissions open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``: a reader sees the old folder or the new one, never a mix. The old
    one is moved aside first (``.NAME.old-PID``); a run killed between the two moves leaves it there, and the next
    call (or :func:`recover_dir`) puts it back before anything else."""
    import shutil

    dst, src = Path(dst), Path(src)
    recover_dir(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_dir(dst: Path) -> None:
    """Undo what a killed :func:`replace_dir` or :func:`atomic_write_bytes` left at ``dst``: a folder moved aside with
    nothing in its place goes back (a second one moved aside, and any moved aside while ``dst`` exists, is removed);
    temporary files of interrupted writes beside ``dst`` are removed."""
    import shutil

    dst = Path(dst)
    if not dst.parent.is_dir():
        return
    aside = sorted(dst.parent.glob(f".{dst.name}.old-*"), key=lambda p: p.stat().st_mtime)
    for folder in aside:
        if not dst.exists():
            os.replace(folder, dst)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    _remove_stale_tmp(dst)


STALE_TMP_SECONDS = 600.0
"""A temporary file of an atomic write untouched this long was left by a write that was killed (a live write finishes
in seconds; a younger one may belong to another process writing the same path)."""


def _remove_stale_tmp(path: Path) -> None:
    import time

    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                tmp.unlink()
        except OSError:
            continue
