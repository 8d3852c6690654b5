"""Rows from any data source: lmforge's own JSONL / Parquet readers, or Hugging Face ``datasets``.

    rows = read_rows("data/train.csv", columns={"prompt": "question"})        # -> Rows
    rows = read_rows("openai/gsm8k", subset="main", split="train")            # hub id, local cache only
    train, held_out = split_by_fraction(rows.rows, 0.1, seed=0)

What ``data.path`` may name (:func:`source_kind` decides, in this order):

- ``*.jsonl`` / ``*.ndjson`` / ``*.json`` (one object per line) and ``*.parquet``: read by lmforge
  itself (no ``datasets`` needed): errors give ``file:line`` (JSONL) or ``file:row N`` (Parquet), and
  JSON rows need not share a schema. A ``.json`` file holding one JSON array goes to ``datasets``.
- ``*.csv`` / ``*.tsv`` / ``*.arrow`` files: ``datasets`` (``csv`` / ``arrow`` builders). CSV cells are
  read as text (an answer ``007`` or ``1.50`` keeps its digits); an empty cell is a missing value.
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (it holds
  ``state.json`` or ``dataset_dict.json``): ``datasets.load_from_disk``.
- any other directory: ``datasets.load_dataset(dir)``, which finds the data files inside (and splits
  from their names, e.g. ``train.csv`` and ``test.csv``).
- anything else is a hub id (``owner/name``), loaded from the local Hugging Face cache only: hub
  access is switched off for the call, so nothing is downloaded at run time; a dataset that is not
  in the cache is a :class:`DataError` that says so and how to fill the cache.

A single file is one split, ``train``. ``columns`` maps lmforge's names to the data's columns
(``{"prompt": "question"}`` reads ``prompt`` from the column ``question``); a mapped column that the
data lacks is an error naming the source, the column and the columns it has. Rows come back as plain
dicts with the lmforge names, and each row keeps where it came from (``file:line`` or
``source:row N``), so the checks that follow can name it.

``datasets`` (with pyarrow and pandas, ~270 MB installed) is the optional extra ``lmforge[data]``:
built-in tasks, JSONL and Parquet work without it; every other source says how to install it.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..core.errors import DataError
from ..core.fileio import read_text, text_lines

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASETS_BUILDERS = {".csv": "csv", ".tsv": "csv", ".arrow": "arrow", ".json": "json", ".txt": "text"}
TEXT_COLUMN_NAMES = ("text",)  # pretraining reads one column: what data.columns may map
INSTALL_HINT = "pip install 'lmforge[data]' (or pip install datasets)"


@dataclass
class Rows:
    """Rows of one split with lmforge's column names; ``where[i]`` names row i for errors."""

    rows: list[dict]
    where: list[str]
    source: str  # the path or hub id, with the split when it matters


def require_datasets(source: str):
    """The ``datasets`` module, or a DataError naming ``source`` and how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source}: reading this source needs Hugging Face datasets: {INSTALL_HINT}") from None
    datasets.disable_progress_bars()  # lmforge prints its own [data] lines
    return datasets


def _json_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (datasets reads it) rather than JSON Lines."""
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def source_kind(path: str) -> str:
    """``jsonl``, ``parquet``, ``file`` (a datasets builder), ``disk`` (save_to_disk), ``dir`` or ``hub``."""
    local = Path(path).expanduser()
    if local.is_dir():
        if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
            return "disk"
        return "dir"
    if local.is_file():
        suffix = local.suffix.lower()
        if suffix == ".parquet":
            return "parquet"
        if suffix in JSONL_SUFFIXES and not (suffix == ".json" and _json_array(local)):
            return "jsonl"
        if suffix in DATASETS_BUILDERS:
            return "file"
        raise DataError(
            f"{local}: unsupported file type {local.suffix!r}; use .jsonl, .parquet, .csv, .tsv, "
            ".arrow, a save_to_disk directory or a hub id (docs/data.md)"
        )
    if path.startswith((".", "/", "~")) or local.suffix.lower() in (*JSONL_SUFFIXES, ".parquet", *DATASETS_BUILDERS):
        raise DataError(f"{local}: data file not found")
    return "hub"


@contextlib.contextmanager
def _hub_offline(datasets):
    """Hub access off for the duration (datasets and huggingface_hub read these flags per call)."""
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _pick_split(loaded, split: str, source: str):
    """The ``split`` of a DatasetDict (or the one Dataset, as split ``train``)."""
    if hasattr(loaded, "keys"):  # DatasetDict / IterableDatasetDict
        if split not in loaded:
            raise DataError(
                f"{source}: no split {split!r}; it has {', '.join(sorted(loaded)) or 'none'} "
                "(set data.split / data.eval_split)"
            )
        return loaded[split]
    if split != "train":
        raise DataError(
            f"{source}: holds a single dataset (split 'train'), not split {split!r}; use "
            "data.split=train and a fraction for the held-out rows"
        )
    return loaded


def _csv_options(datasets, path: str) -> dict:
    """CSV cells stay text (an answer "007" or "1.50" is not turned into a number); tabs for .tsv."""
    import csv

    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    with open(path, newline="", encoding="utf-8-sig") as handle:
        header = next(csv.reader(handle, delimiter=delimiter), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, **({"delimiter": delimiter} if delimiter != "," else {})}


def open_dataset(path: str, split: str = "train", subset: str = "", streaming: bool = False):
    """The ``split`` of a datasets-backed source as a ``Dataset`` (``IterableDataset`` when streaming)."""
    kind = source_kind(path)
    datasets = require_datasets(path)
    local = str(Path(path).expanduser())
    from ..model.load import cache_dir  # same layer; the arrow caches of local files live under lmforge's cache

    cache = str(cache_dir() / "datasets")
    try:
        if kind == "disk":
            loaded = _pick_split(datasets.load_from_disk(local), split, path)
            return loaded.to_iterable_dataset() if streaming else loaded
        if kind in ("file", "parquet", "jsonl"):
            if split != "train":
                _pick_split(None, split, path)
            builder = (
                "parquet"
                if kind == "parquet"
                else "json"
                if kind == "jsonl"
                else DATASETS_BUILDERS[Path(local).suffix.lower()]
            )
            extra = _csv_options(datasets, local) if builder == "csv" else {}
            return datasets.load_dataset(
                builder, data_files={"train": local}, split="train", cache_dir=cache, streaming=streaming, **extra
            )
        if kind == "dir":
            csvs = sorted(p for p in Path(local).rglob("*") if p.suffix.lower() in (".csv", ".tsv"))
            extra = _csv_options(datasets, str(csvs[0])) if csvs else {}
            return _pick_split(datasets.load_dataset(local, cache_dir=cache, streaming=streaming, **extra), split, path)
        with _hub_offline(datasets):
            try:
                loaded = datasets.load_dataset(path, subset or None, streaming=streaming)
            except (ConnectionError, FileNotFoundError) as exc:
                raise DataError(
                    f"{path}: not a local file or directory, and not in the local Hugging Face datasets cache "
                    f"({datasets.config.HF_DATASETS_CACHE}); lmforge never downloads at run time. Fill the cache "
                    f'once on a machine with network access: python -c "import datasets; '
                    f"datasets.load_dataset('{path}'{', ' + repr(subset) if subset else ''})\" (with the same "
                    f"HF_HOME / HF_DATASETS_CACHE), or save it with save_to_disk and set data.path to that "
                    f"directory ({type(exc).__name__}: {exc})"
                ) from None
            except ValueError as exc:  # e.g. several cached configs and none chosen
                raise DataError(f"{path}: {exc} (set data.subset to choose a config)") from None
        return _pick_split(loaded, split, path)
    except DataError:
        raise
    except ValueError as exc:
        if "corresponds to no data" in str(exc):  # a file with a header and no rows
            raise DataError(
                f"{path}: file has no rows"
                if kind in ("file", "parquet", "jsonl")
                else f"{path} (split {split!r}): no rows"
            ) from None
        raise DataError(f"{path}: cannot read it as a dataset: ValueError: {exc}") from None
    # datasets / pyarrow raise many types for a bad file (ArrowInvalid, DatasetGenerationError...)
    except Exception as exc:  # noqa: BLE001 - reported below as a DataError naming the file
        cause = exc.__cause__ or exc
        raise DataError(f"{path}: cannot read it as a dataset: {type(cause).__name__}: {cause}") from None


def check_columns(columns: dict[str, str] | None, have: list[str] | None, source: str) -> dict[str, str]:
    """``columns`` checked against the data's column names ``have`` (None: rows have no schema)."""
    columns = dict(columns or {})
    if have is not None:
        for name, column in columns.items():
            if column not in have:
                raise DataError(
                    f"{source}: data.columns maps {name!r} to column {column!r}, which the data does "
                    f"not have (columns: {', '.join(have)})"
                )
    return columns


def rename_row(row: dict, columns: dict[str, str], where: str) -> dict:
    """``row`` with each mapped column under its lmforge name (a missing column names the row)."""
    if not columns:
        return row
    for name, column in columns.items():
        if column not in row:
            raise DataError(
                f"{where}: no column {column!r} (data.columns maps {name!r} to it); the row has "
                f"{', '.join(sorted(row)) or 'no columns'}"
            )
    # the unmapped columns as they are, then every mapped one from the original row: a swap
    # ({prompt: answer, answer: prompt}) and two names for one column both come out right
    out = {key: value for key, value in row.items() if key not in set(columns.values())}
    out.update({name: row[column] for name, column in columns.items()})
    return out


def _jsonl_rows(path: Path, what: str) -> Iterator[tuple[str, Any]]:
    for number, line in text_lines(path, f"{what} (JSON Lines)"):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno}); each line must "
                f"hold one JSON object{_whole_document(path) if number == 1 else ''}"
            ) from None
        except _DuplicateKey as dup:
            raise DataError(
                f"{path}:{number}: key {dup.args[0]!r} is given twice in one object; JSON keeps only the "
                "last value without a word. Keep one of them"
            ) from None
        yield f"{path}:{number}", row


class _DuplicateKey(ValueError):
    """A JSON object with a key given twice (``json`` would keep the last value silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _whole_document(path: Path) -> str:
    """When a file that fails as JSON Lines is one JSON object (pretty-printed, rows under a key):
    what it holds, for the error message; else ''."""
    try:
        document = json.loads(read_text(path, "data file"))
    except (DataError, ValueError):
        return ""
    if not isinstance(document, dict):
        return ""
    keys = ", ".join(map(repr, list(document)[:5]))
    return (
        f". The file is one JSON object (keys {keys}), not rows: write its rows as JSON Lines (one object "
        "per line) or as one JSON array of row objects in a .json file"
    )


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'lmforge[parquet]'") from None
    import pyarrow

    try:
        table = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    for number, row in enumerate(table, start=1):
        yield f"{path}:row {number}", {k: v for k, v in row.items() if v is not None}  # absent in this row


def read_rows(
    path: str, split: str = "train", subset: str = "", columns: dict[str, str] | None = None, what: str = "data file"
) -> Rows:
    """All rows of ``split`` of ``path`` (module doc); an empty split is an error naming it.
    ``what`` names the file in encoding errors (e.g. "SFT data file")."""
    kind = source_kind(path)
    local = Path(path).expanduser()
    if kind in ("jsonl", "parquet"):
        if split != "train":
            _pick_split(None, split, path)
        pairs = list(_jsonl_rows(local, what) if kind == "jsonl" else _parquet_rows(local))
        source = str(local)
    else:
        dataset = open_dataset(path, split, subset)
        source = path if kind == "file" else f"{path} (split {split!r})"
        check_columns(columns, list(dataset.column_names), source)
        pairs = [
            (f"{source}:row {number}", {k: v for k, v in row.items() if v is not None})
            for number, row in enumerate(dataset, start=1)
        ]
    if not pairs:
        raise DataError(f"{source}: file has no rows" if kind in ("jsonl", "parquet", "file") else f"{source}: no rows")
    rows, where = [], []
    for place, row in pairs:  # a row that is not an object is left for the caller's check to name
        rows.append(rename_row(row, columns or {}, place) if isinstance(row, dict) else row)
        where.append(place)
    return Rows(rows, where, source)


def split_by_fraction(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """(kept, held out): shuffled with ``seed``; ``max(1, int(n * fraction))`` held out when n > 1.

    Deterministic in (items, fraction, seed); the held-out items are the first of the shuffled order,
    so a larger fraction holds out a superset.
    """
    items = list(items)
    random.Random(seed).shuffle(items)
    num_held = max(1, int(len(items) * fraction)) if len(items) > 1 and fraction > 0 else 0
    return items[num_held:], items[:num_held]


def string_column(row: dict, name: str, where: str, hint: str = "") -> str:
    """``row[name]`` if it is a string, else a DataError naming the row and column."""
    if name not in row:
        raise DataError(f"{where}: no {name!r} column{hint}; the row has {', '.join(sorted(row)) or 'no columns'}")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: column {name!r} must be a string, got {type(value).__name__} ({value!r:.60})")
    return value


def read_text_column(
    path: str, split: str = "train", subset: str = "", columns: dict[str, str] | None = None, streaming: bool = False
) -> Iterator[str]:
    """The ``text`` column (after ``columns``) of a source, one document at a time (pretraining).

    JSONL / Parquet / datasets sources alike; with ``streaming`` a datasets source is read as an
    ``IterableDataset`` and never held in memory whole.
    """
    kind = source_kind(path)
    columns = dict(columns or {})
    column = columns.get("text", "text")
    if kind in ("jsonl", "parquet") and not streaming:
        rows = read_rows(path, split, subset, {"text": column} if column != "text" else None)
        for row, where in zip(rows.rows, rows.where):
            yield string_column(row, "text", where, " (map one with data.columns={text: <column>})")
        return
    dataset = open_dataset(path, split, subset, streaming=streaming)
    source = path if kind in ("file", "parquet", "jsonl") else f"{path} (split {split!r})"
    names = dataset.column_names
    if names is not None and column not in names:
        raise DataError(
            f"{source}: no column {column!r} for the text (columns: {', '.join(names)}); map one with "
            "data.columns={text: <column>}"
        )
    number = 0
    for number, row in enumerate(dataset, start=1):
        yield string_column(row, column, f"{source}:row {number}")
    if number == 0:
        raise DataError(f"{source}: no rows")
