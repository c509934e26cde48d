"""The documents of `--data`, read from the formats corpora are kept in, one at a time.

- Plain text: a file, or every non-hidden file below a folder in name order; each file is a
  document. A file with a NUL byte is skipped as binary; bytes that are not UTF-8 become U+FFFD.
  Gzip'd (`.gz`) and zstandard (`.zst`) text files are read decompressed.
- Parquet (`.parquet`): each row's `text_column` is a document (FineWeb, DCLM, SlimPajama...).
- Arrow (`.arrow`, the IPC stream or file format: the shards `datasets` writes): the same.
- JSON Lines (`.jsonl`, `.ndjson`, also gzip'd `.gz` and zstandard `.zst` where the `zstandard`
  package is installed): each line an object whose `text_column` is a document.
- A JSON array (a `.json` file whose text begins with `[`): each element an object whose
  `text_column` is a document, or a string.
- CSV (`.csv`, also compressed) with a header row: each row's `text_column` is a document.
- A `datasets` `save_to_disk` folder (`state.json` or `dataset_dict.json`; its "train" split):
  each row a document, read through `datasets` (`pip install fastlm[data]`).

A folder that holds record files (Parquet, Arrow, JSON Lines, JSON arrays, CSV) anywhere below it
(a local copy of a Hugging Face dataset, which `load_dataset` reads the same way) is read as those
files in name order; its other files (README.md, licences, text files) are not text of the
corpus, and `Reading.left_out` lists them for the commands to say so. Everything streams:
Parquet by record batches, Arrow and `datasets` folders memory-mapped, JSON Lines line by line,
so a corpus larger than memory goes through `fastlm-prepare`. Bad input is one DataError line
naming the file and the record (counted from 1): a missing column, a record that is not text
(with `skip_empty`, a null or empty text is skipped and counted instead), a truncated file.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PARQUET = (".parquet",)
ARROW = (".arrow",)
JSON_LINES = (".jsonl", ".ndjson", ".json")  # .json only compressed: .json.gz, .json.zst
CSV = (".csv",)
COMPRESSED = (".gz", ".zst")
RECORDS = ("parquet", "arrow", "jsonl", "json", "csv")
DATASETS_MARKERS = ("state.json", "dataset_dict.json")

# Rows read from a Parquet file or a `datasets` folder at a time: a few MB of text.
ROWS_PER_BATCH = 1024


class DataError(ValueError):
    """Bad user input about the corpus or tokenizer (the command prints it and exits with 2)."""


@dataclass(frozen=True)
class Source:
    """One file (or `datasets` folder) of the corpus and how to read it."""

    path: Path
    kind: str  # "text", "parquet", "arrow", "jsonl", "json" (an array), "csv" or "datasets"


@dataclass
class Reading:
    """How to read, and what reading skipped, left out or repaired."""

    skip_empty: bool = False  # skip (and count) records whose text is null or empty
    skipped: list[Path] = field(default_factory=list)  # binary: a NUL byte (also UTF-16/32)
    replaced: dict[Path, int] = field(default_factory=dict)  # bytes that are not UTF-8
    left_out: list[Path] = field(default_factory=list)  # files beside the records of a folder
    empty_records: int = 0  # null or empty texts skipped (skip_empty)
    unused: str = ""  # a note on an option the sources do not use (--text-column)
    # How much of the source being read is read, from 0 to 1, when called (for progress bars:
    # its records against its row count, or its file's bytes read; compressed bytes for a
    # compressed file; a file read whole jumps from 0 to 1).
    fraction: Callable[[], float] = lambda: 0.0


def notes(reading: Reading) -> list[str]:
    """The lines that tell a user what reading repaired, left out or skipped."""
    lines = [reading.unused] if reading.unused else []
    lines += [
        f"warning: {path} is not valid UTF-8: {count} undecodable bytes replaced by U+FFFD"
        for path, count in reading.replaced.items()
    ]
    if reading.left_out:
        shown = ", ".join(str(p) for p in reading.left_out[:5])
        more = f" and {len(reading.left_out) - 5} more" if len(reading.left_out) > 5 else ""
        lines.append(
            f"note: {len(reading.left_out)} files beside the corpus's records are left out (not "
            f"Parquet, Arrow, JSON Lines, JSON array or CSV files): {shown}{more}"
        )
    if reading.empty_records:
        lines.append(f"note: {reading.empty_records:,} records with null or empty text skipped")
    return lines


def kind_of(path: Path) -> str:
    """ "parquet", "arrow", "jsonl", "json" (an array), "csv" or "text", from the file's name
    (and for a plain `.json`, its first character)."""
    name = path.name.lower()
    if name.endswith(PARQUET):
        return "parquet"
    if name.endswith(ARROW):
        return "arrow"
    stem = name
    for suffix in COMPRESSED:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            if stem.endswith(JSON_LINES):
                return "jsonl"
    if stem.endswith(CSV):
        return "csv"
    if name.endswith(".json") and _starts_an_array(path):
        return "json"
    return "jsonl" if stem.endswith(JSON_LINES[:2]) else "text"


def _starts_an_array(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4096).lstrip().startswith(b"[")
    except OSError:
        return False


def is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in DATASETS_MARKERS)


def sources(
    data: str | os.PathLike,
    exclude: tuple[str | os.PathLike, ...] = (),
    reading: Reading | None = None,
) -> list[Source]:
    """The sources of `--data` in reading order (see the module docstring), leaving out what lies
    in those of the folders `exclude` that lie inside it (a command's own output); `reading`
    gets the files a folder of records leaves out."""
    root = Path(data)
    inside = Path(os.path.realpath(root))
    excluded = {Path(os.path.realpath(folder)) for folder in exclude}
    excluded = {folder for folder in excluded if inside in folder.parents}
    if root.is_file():
        return [Source(root, kind_of(root))]
    if not root.is_dir():
        raise DataError(f"--data: no such file or folder: {root}")
    if is_datasets_folder(root):
        return [Source(root, "datasets")]

    def left_out(p: Path) -> bool:
        hidden = any(part.startswith(".") for part in p.relative_to(root).parts)
        return hidden or bool(excluded and excluded & set(Path(os.path.realpath(p)).parents))

    files = sorted(p for p in root.rglob("*") if p.is_file() and not left_out(p))
    found = [Source(p, kind_of(p)) for p in files]
    records = [source for source in found if source.kind in RECORDS]
    if records and reading is not None:
        reading.left_out.extend(s.path for s in found if s.kind not in RECORDS)
    return records or found


#: The default corpus's size: top-level standard-library sources, in name order, up to this.
DEFAULT_CORPUS_BYTES = 2_000_000


def default_corpus_files(limit_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """Top-level standard-library `.py` files in name order, up to `limit_bytes` in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= limit_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise DataError(f"no Python sources found in {stdlib} for the default corpus; pass --data")
    return files


def corpus_sources(
    data: str | os.PathLike | None,
    exclude: tuple[str | os.PathLike, ...] = (),
    reading: Reading | None = None,
    text_column: str = "text",
) -> list[Source]:
    """The sources of `--data` (`sources`), or the default corpus's files; `reading` also gets
    a note when a --text-column other than "text" meets text files only."""
    if data is None:
        found = [Source(path, "text") for path in default_corpus_files()]
    else:
        found = sources(data, exclude, reading)
    if reading is not None and text_column != "text" and all(s.kind == "text" for s in found):
        reading.unused = (
            f"note: --text-column {text_column} is unused: the corpus is text files, each read "
            "whole"
        )
    return found


def stats(found: list[Source]) -> list[dict]:
    """Each source's path, size and modification time (a folder: the sums and the latest)."""
    rows = []
    for source in found:
        files = [source.path] if source.path.is_file() else sorted(source.path.rglob("*"))
        infos = [p.stat() for p in files if p.is_file()]
        rows.append(
            {
                "path": str(source.path.absolute()),
                "size": sum(i.st_size for i in infos),
                "mtime": max((i.st_mtime for i in infos), default=0.0),
            }
        )
    return rows


def bytes_read(reading: Reading, before: int, size: int) -> int:
    """For a progress bar: `before`, the bytes of the sources read whole, and the part read of
    the one being read (`size` bytes)."""
    return before + round(size * min(reading.fraction(), 1))


def documents(found: list[Source], text_column: str, reading: Reading) -> Iterator[str]:
    """The documents of the sources in order, as text."""
    for source in found:
        yield from read_source(source, text_column, reading)


def read_source(source: Source, text_column: str, reading: Reading) -> Iterator[str]:
    """One source's documents in order (its records, or the text file's whole text)."""
    reading.fraction = lambda: 0.0
    if source.kind == "text":
        return _text_file(source.path, reading)
    readers = {
        "parquet": _parquet,
        "arrow": _arrow,
        "jsonl": _json_lines,
        "json": _json_array,
        "csv": _csv,
        "datasets": _datasets,
    }
    texts = readers[source.kind](source.path, text_column, reading)
    return _kept(texts, source, text_column, reading)


def _kept(
    texts: Iterator[str | None], source: Source, text_column: str, reading: Reading
) -> Iterator[str]:
    """The records' texts: with skip_empty, null and empty ones skipped and counted; without,
    a null one refused."""
    for record, text in enumerate(texts, 1):
        if reading.skip_empty and not text:
            reading.empty_records += 1
        elif text is None:
            raise DataError(
                f"{source.path}, record {record}: {text_column!r} is null, not text "
                "(--skip-empty skips such records)"
            )
        else:
            yield text


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


def _text_file(path: Path, reading: Reading) -> Iterator[str]:
    try:
        with _open_bytes(path) as f:
            raw = f.read()
    except (EOFError, OSError) as error:
        raise DataError(f"{path}: the file is truncated or damaged ({error})") from None
    reading.fraction = lambda: 1.0
    if b"\0" in raw:
        reading.skipped.append(path)
        return
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError:
        # surrogateescape keeps each undecodable byte as one lone surrogate: count them.
        escaped = raw.decode("utf-8", errors="surrogateescape")
        reading.replaced[path] = sum(0xDC80 <= ord(c) <= 0xDCFF for c in escaped)
        yield raw.decode("utf-8", errors="replace")


def _checked(value: object, path: Path, record: int, text_column: str) -> str | None:
    """The record's text; None for a null one, which `read_source` skips with `skip_empty`
    (and refuses otherwise)."""
    if isinstance(value, str):
        return value
    if value is None:
        return None
    raise DataError(
        f"{path}, record {record}: {text_column!r} is a {type(value).__name__}, not text"
    )


def _no_column(path: Path, text_column: str, columns: list[str]) -> DataError:
    shown = ", ".join(map(repr, columns[:8])) + (", ..." if len(columns) > 8 else "")
    return DataError(
        f"{path}: no column {text_column!r} (it has {shown or 'none'}): pass --text-column"
    )


def _rows(
    path: Path, text_column: str, batches: Iterator[list], rows: int | None, reading: Reading
) -> Iterator[str]:
    """The text of each row of `batches` (lists of the column's values, `rows` in all: None
    when the caller measures `reading.fraction` itself), checked."""
    import pyarrow as pa

    record = 0
    if rows is not None:
        reading.fraction = lambda: record / max(rows, 1)
    try:
        for values in batches:
            for value in values:
                record += 1
                yield _checked(value, path, record, text_column)
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"{path}, after record {record}: the file is truncated or damaged ({error})"
        ) from None


def _parquet(path: Path, text_column: str, reading: Reading) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"{path}: not a readable Parquet file, truncated or damaged ({error})"
        ) from None
    if text_column not in file.schema_arrow.names:
        raise _no_column(path, text_column, file.schema_arrow.names)
    batches = file.iter_batches(batch_size=ROWS_PER_BATCH, columns=[text_column])
    texts = (batch.column(0).to_pylist() for batch in batches)
    yield from _rows(path, text_column, texts, file.metadata.num_rows, reading)


def _arrow(path: Path, text_column: str, reading: Reading) -> Iterator[str]:
    """An Arrow IPC file, memory-mapped: the stream format `datasets` writes its shards in, or
    the file format."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
            schema, batches = reader.schema, iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        size = max(source.size(), 1)
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"{path}: not a readable Arrow file, truncated or damaged ({error})"
        ) from None
    if text_column not in schema.names:
        raise _no_column(path, text_column, schema.names)
    index = schema.get_field_index(text_column)
    texts = (batch.column(index).to_pylist() for batch in batches)
    # The stream format keeps no row count: the fraction is the memory map's bytes passed.
    reading.fraction = lambda: source.tell() / size
    yield from _rows(path, text_column, texts, None, reading)


def _open_bytes(path: Path, reading: Reading | None = None) -> io.BufferedIOBase:
    """The file's bytes, decompressed for `.gz` and `.zst`; `reading.fraction` then follows the
    file's bytes read (compressed ones for a compressed file) as the stream is read."""
    name = path.name.lower()
    if name.endswith(".gz"):
        stream = gzip.open(path, "rb")
        raw = stream.fileobj
    elif name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{path}: reading .zst files needs the zstandard package: pip install zstandard"
            ) from None
        raw = open(path, "rb")
        stream = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
    else:
        stream = raw = open(path, "rb")
    if reading is not None:
        size = max(os.fstat(raw.fileno()).st_size, 1)
        reading.fraction = lambda: 1.0 if raw.closed else raw.tell() / size
    return stream


def _open_lines(path: Path, reading: Reading) -> io.TextIOBase:
    return io.TextIOWrapper(_open_bytes(path, reading), encoding="utf-8", newline="")


def _json_lines(path: Path, text_column: str, reading: Reading) -> Iterator[str]:
    record = 0
    try:
        with _open_lines(path, reading) as lines:
            for line in lines:
                if not line.strip():
                    continue
                record += 1
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    ends = "" if line.endswith("\n") else " (the last line is cut: truncated?)"
                    raise DataError(
                        f"{path}, record {record}: not valid JSON ({error}){ends}"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}, record {record}: a JSON {type(row).__name__}, not an object"
                    )
                if text_column not in row:
                    raise DataError(
                        f"{path}, record {record}: no field {text_column!r} (it has "
                        f"{', '.join(map(repr, list(row)[:8])) or 'none'}): pass --text-column"
                    )
                yield _checked(row[text_column], path, record, text_column)
    except (EOFError, OSError, UnicodeDecodeError) as error:
        # gzip: EOFError at a cut stream; zstandard: its ZstdError, an OSError... or a
        # ValueError subclass in some versions (caught below).
        raise DataError(
            f"{path}, after record {record}: the file is truncated or damaged ({error})"
        ) from None
    except ValueError as error:
        if isinstance(error, DataError):
            raise
        raise DataError(
            f"{path}, after record {record}: the file is truncated or damaged ({error})"
        ) from None


def _json_array(path: Path, text_column: str, reading: Reading) -> Iterator[str | None]:
    """A JSON array of objects (their `text_column`) or of strings, read whole."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a readable JSON array ({error})") from None
    record = 0
    reading.fraction = lambda: record / max(len(rows), 1)
    for record, row in enumerate(rows, 1):
        if isinstance(row, dict):
            if text_column not in row:
                raise DataError(
                    f"{path}, record {record}: no field {text_column!r} (it has "
                    f"{', '.join(map(repr, list(row)[:8])) or 'none'}): pass --text-column"
                )
            row = row[text_column]
        yield _checked(row, path, record, text_column)


def _csv(path: Path, text_column: str, reading: Reading) -> Iterator[str | None]:
    """A CSV file with a header row: each row's `text_column` (an empty cell is empty text)."""
    record = 0
    try:
        with _open_lines(path, reading) as lines:
            csv.field_size_limit(2**31 - 1)  # a document may be long: not the 128 KiB default
            reader = csv.DictReader(lines)
            if text_column not in (reader.fieldnames or []):
                raise _no_column(path, text_column, list(reader.fieldnames or []))
            for record, row in enumerate(reader, 1):
                yield _checked(row[text_column], path, record, text_column)
    except (EOFError, OSError, UnicodeDecodeError, csv.Error) as error:
        raise DataError(
            f"{path}, after record {record}: the file is truncated or damaged ({error})"
        ) from None


def _datasets(path: Path, text_column: str, reading: Reading) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path} is a `datasets` folder: reading it needs the datasets package: "
            "pip install 'fastlm[data]'"
        ) from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid...
        raise DataError(f"{path}: not a readable `datasets` folder ({error})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"{path}: no 'train' split (it has {', '.join(dataset)})")
        dataset = dataset["train"]
    if text_column not in dataset.column_names:
        raise _no_column(path, text_column, dataset.column_names)
    batches = dataset.select_columns([text_column]).iter(batch_size=ROWS_PER_BATCH)
    texts = (batch[text_column] for batch in batches)
    yield from _rows(path, text_column, texts, len(dataset), reading)
