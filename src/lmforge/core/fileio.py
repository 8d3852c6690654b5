"""Reading user files as text: every failure becomes a project error naming the file (and line).

    text = read_text(path, "config file", ConfigError)
    for number, line in text_lines(path, "SFT data file"):   # JSONL, streamed, 1-based line numbers
        ...

A file that is missing, a directory, unreadable, binary (NUL bytes), UTF-16/32, or not valid UTF-8
raises ``error`` (DataError by default) with the path, the line where there is one, and what was
expected. A UTF-8 byte-order mark is dropped, since JSON and YAML parsers would trip over it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .errors import DataError, LmforgeError

_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}  # UTF-32 first: its little-endian mark starts like UTF-16's


def _open_error(path: Path, what: str, exc: OSError, error: type[LmforgeError]) -> LmforgeError:
    if isinstance(exc, FileNotFoundError):
        return error(f"{path}: {what} not found")
    if isinstance(exc, IsADirectoryError):
        return error(f"{path}: expected a {what}, found a directory")
    return error(f"{path}: cannot read {what}: {exc.strerror or exc}")


def _decode(raw: bytes, path: Path, what: str, number: int | None, error: type[LmforgeError]) -> str:
    """``raw`` as UTF-8; ``number`` is the 1-based line of ``raw`` (None: ``raw`` is the whole file)."""
    if number in (None, 1):
        for bom, name in _OTHER_BOMS.items():
            if raw.startswith(bom):
                raise error(
                    f"{path}: not UTF-8 text (it is {name}-encoded); the {what} must be UTF-8: re-save it as UTF-8"
                )
    if b"\x00" in raw:
        line = number or raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (it holds NUL bytes: a binary file?); the {what} must be UTF-8 text"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = number or raw[: err.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} is invalid there); the "
            f"{what} must be UTF-8: re-save it as UTF-8"
        ) from None


def read_text(path: str | Path, what: str, error: type[LmforgeError] = DataError) -> str:
    """The whole of ``path`` as UTF-8 text (see module doc for the errors)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _open_error(path, what, exc, error) from None
    return _decode(raw.removeprefix(_UTF8_BOM), path, what, None, error)


def text_lines(path: str | Path, what: str, error: type[LmforgeError] = DataError) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` pairs of a UTF-8 text file, read one line at a time (for JSONL)."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise _open_error(path, what, exc, error) from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1:
                raw = raw.removeprefix(_UTF8_BOM)
            yield number, _decode(raw, path, what, number, error)
