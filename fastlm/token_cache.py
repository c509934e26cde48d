"""A corpus tokenized once (`fastlm-prepare`), memory-mapped by `fastlm-train --data DIR`.

    DIR/tokens.bin         every token id, uint16 when the vocabulary fits, else uint32, in
                           corpus order: the training part, then the held-out part
    DIR/documents.bin      int64 offsets into tokens.bin where documents begin (--pack-documents)
    DIR/tokenizer.json     a copy of the Hugging Face tokenizer, when one was used
    DIR/fastlm-cache.json  the metadata: format version, fastlm version, tokenizer name (the byte
                           tokenizer's "bytes", or "hf-" and its file's SHA-256 prefix), sources
                           with their sizes and mtimes, token and document counts, options

Each document (a text file, or a record of a Parquet, JSON Lines or `datasets` corpus) is
tokenized on its own with `document_end` ("\\n" by default, say "<|endoftext|>" for a tokenizer
that has it) appended, so its tokens do not depend on its neighbours: the corpus is cut into
chunks of whole documents, `workers` processes tokenize chunks, and the main process writes
them in corpus order. 2 workers write the very bytes 1 does.

The folder appears whole or not at all: the files grow in `DIR.partial`, which is renamed to DIR
at the end. After each chunk the files are flushed to disk and `DIR.partial/progress.json`
records how many documents and tokens they hold, so an interrupted run (Ctrl-C, a crash, a full
disk) resumes from there when started again with the same sources, tokenizer and options.

Training reads a cache without loading it: each rank memory-maps the file and takes a
contiguous shard of the training part and of the held-out part (the data ranks split both
evenly), so it only ever reads the pages of its own windows. A cache made with another tokenizer
or another format version is refused.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

import fastlm
from fastlm import corpus
from fastlm.corpus import DataError, Reading, corpus_sources
from fastlm.overwrite import check_spares_inputs
from fastlm.tokens import (
    Tokenizer,
    TokenSplit,
    check_long_enough,
    check_marker,
    load_tokenizer,
    lossy_note,
)

FORMAT = "fastlm-token-cache"
FORMAT_VERSION = 1
METADATA = "fastlm-cache.json"
TOKENS = "tokens.bin"
DOCUMENTS = "documents.bin"
TOKENIZER = "tokenizer.json"
PROGRESS = "progress.json"
PARTIAL = ".partial"

# Characters of text per chunk handed to a worker: large enough that handing it over costs
# little against tokenizing it, small enough that an interruption loses little.
CHUNK_CHARS = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_cache(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def check_not_partial(path: str | os.PathLike) -> None:
    """DataError for an unfinished `fastlm-prepare` folder (DIR.partial), which is no corpus."""
    if (Path(path) / PROGRESS).is_file() and (Path(path) / TOKENS).is_file():
        raise DataError(
            f"{path} is an unfinished fastlm-prepare folder: run the same fastlm-prepare "
            "command again to finish it"
        )


def read_metadata(folder: str | os.PathLike) -> dict:
    """The cache's metadata, checked to be of this format version (DataError otherwise)."""
    path = Path(folder) / METADATA
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a readable fastlm-prepare metadata file ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path} was not written by fastlm-prepare")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{folder} was prepared in format version {meta.get('format_version')} (fastlm "
            f"{meta.get('fastlm_version')}), and this fastlm {fastlm.__version__} reads "
            f"version {FORMAT_VERSION}: run fastlm-prepare again"
        )
    return meta


# --------------------------------------------------------------------------------------------
# Reading a cache
# --------------------------------------------------------------------------------------------


class TokenFile:
    """A stretch of a memory-mapped token file, which `fastlm.data.batch_at` indexes like a
    tensor: slices are views, and an index tensor reads just those tokens (as int64)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TokenFile(self.array[index])
        return torch.from_numpy(self.array[np.asarray(index)].astype(np.int64))


def _shard(length: int, rank: int, world_size: int) -> tuple[int, int]:
    size = length // world_size
    return rank * size, (rank + 1) * size


def load_split(
    folder: str | os.PathLike,
    tokenizer: Tokenizer,
    context_length: int,
    rank: int = 0,
    world_size: int = 1,
    pack_documents: bool = False,
    warn: Callable[[str], None] | None = None,
    val_fraction: float | None = None,
) -> TokenSplit:
    """This rank's shard of the cache's training and held-out parts, memory-mapped (and with
    pack_documents the document starts in each); DataError for a cache of another tokenizer or
    format version, a truncated file, or a shard too small for one window. `warn` gets a note
    for sources changed since and for a `val_fraction` other than the cache's split."""
    folder = Path(folder)
    meta = read_metadata(folder)
    if meta["tokenizer"] != tokenizer.name:
        raise DataError(
            f"{folder} was tokenized with tokenizer {meta['tokenizer']}, but this run uses "
            f"{tokenizer.name}: pass the --tokenizer it was prepared with (its copy is "
            f"{folder / TOKENIZER}) or prepare it again"
            if meta["tokenizer"] != "bytes"
            else f"{folder} was tokenized with the byte tokenizer: leave out --tokenizer"
        )
    if meta.get("vocab_size") != tokenizer.vocab_size:
        # The same tokenizer file (its digest matched) counted otherwise: an earlier fastlm
        # counted a vocabulary with gaps in its ids short and cut ids past 65535 to 16 bits.
        raise DataError(
            f"{folder} records a vocabulary of {meta.get('vocab_size')} ids, but its tokenizer "
            f"has ids up to {tokenizer.vocab_size - 1}: an older fastlm-prepare stored them "
            "wrongly, prepare it again"
        )
    if warn is not None and val_fraction not in (None, meta["val_fraction"]):
        warn(
            f"note: the held-out part of {folder} is its last {meta['val_fraction']} (set by "
            f"fastlm-prepare --val-fraction), not --val-fraction {val_fraction}"
        )
    if warn is not None:
        changed = [s["path"] for s in stale_sources(meta)]
        if changed:
            warn(
                f"note: {len(changed)} of the sources of {folder} changed since it was prepared "
                f"({changed[0]}{', ...' if len(changed) > 1 else ''}): it holds their old text"
            )
    dtype, total = np.dtype(meta["dtype"]), meta["tokens"]
    tokens_path = folder / TOKENS
    size = tokens_path.stat().st_size if tokens_path.is_file() else 0
    if size != total * dtype.itemsize:
        raise DataError(
            f"{tokens_path} holds {size} bytes, not the {total * dtype.itemsize} of its "
            f"{total} tokens: the cache is damaged, prepare it again"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(total,))
    n_train = meta["train_tokens"]
    parts = []
    for first, end in ((0, n_train), (n_train, total)):
        lo, hi = _shard(end - first, rank, world_size)
        parts.append((first + lo, first + hi))
    split = TokenSplit(*(TokenFile(tokens[lo:hi]) for lo, hi in parts))
    if pack_documents:
        starts = np.fromfile(folder / DOCUMENTS, dtype=np.int64)
        split.train_starts, split.val_starts = (
            torch.from_numpy(starts[(starts >= lo) & (starts < hi)] - lo) for lo, hi in parts
        )
    check_long_enough(split, context_length, world_size, f"the prepared corpus {folder}")
    return split


def stale_sources(meta: dict) -> list[dict]:
    """The recorded sources whose size or mtime differ now (missing ones are not counted: a
    cache may be used where its sources are not)."""
    stale = []
    for source in meta["sources"]:
        path = Path(source["path"])
        if path.exists():
            now = corpus.stats([corpus.Source(path, "datasets" if path.is_dir() else "text")])[0]
            if (now["size"], now["mtime"]) != (source["size"], source["mtime"]):
                stale.append(source)
    return stale


# --------------------------------------------------------------------------------------------
# Preparing a cache
# --------------------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_path: str | None) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the main process alone handles it (and ends us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_chunk(texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's documents tokenized one by one: (their tokens one after another, each one's
    length); a document that cannot be encoded raises (its position in the chunk, the reason)."""
    tokenizer = _worker_tokenizer
    pieces, lengths = [], np.empty(len(texts), dtype=np.int64)
    for position, text in enumerate(texts):
        try:
            ids = tokenizer.encode(text).numpy()
        except DataError as error:
            raise _EncodeError(position, str(error)) from None
        pieces.append(ids.astype(dtype, copy=False))
        lengths[position] = len(ids)
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    return tokens, lengths


class _EncodeError(Exception):
    def __init__(self, position: int, reason: str):
        super().__init__(position, reason)
        self.position, self.reason = position, reason


def _chunks(
    found: list[corpus.Source],
    text_column: str,
    reading: Reading,
    document_end: str,
    separator: str | None,
    skip: int,
    found_text: list[bool],
    sizes: list[int],
) -> Iterator[tuple[list[str], tuple[list[str], int]]]:
    """(texts, (where each comes from, the sources' bytes read so far)) for chunks of whole
    documents, after the first `skip`; `sizes` are the sources' sizes in bytes; found_text[0]
    becomes True at the first document that is not all whitespace."""
    texts, labels, chars, seen, before = [], [], 0, 0, 0
    for source, size in zip(found, sizes):
        for record, text in enumerate(corpus.read_source(source, text_column, reading), 1):
            pieces = [text]
            if separator:
                pieces = [p + separator for p in text.split(separator)]
                pieces[-1] = pieces[-1][: -len(separator)]
                pieces = [p for p in pieces if p] or [""]
            found_text[0] = found_text[0] or bool(text.strip())
            for piece in pieces:
                seen += 1
                if seen <= skip:
                    continue
                where = f"{source.path}, record {record}" if source.kind != "text" else source.path
                texts.append(piece + document_end)
                labels.append(where)
                chars += len(piece)
                if chars >= CHUNK_CHARS:
                    yield texts, (labels, corpus.bytes_read(reading, before, size))
                    texts, labels, chars = [], [], 0
        before += size
    if texts:
        yield texts, (labels, before)


def _in_order(chunks: Iterator, workers: int, tokenizer_path: str | None, dtype: np.dtype):
    """(labels, result of _encode_chunk) for each chunk, in corpus order; with several workers at
    most 2 chunks per worker are in flight (reading never runs far ahead of writing)."""
    if workers == 1:  # in this process, whose settings stay as they are
        global _worker_tokenizer
        _worker_tokenizer = load_tokenizer(tokenizer_path)
        for texts, labels in chunks:
            yield labels, _try(lambda t=texts: _encode_chunk(t, dtype))
        return
    method = "fork" if sys.platform == "linux" else "spawn"
    context = multiprocessing.get_context(method)
    with _default_sigterm():
        pool = context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_path,))
    with pool:
        pending = collections.deque()
        for texts, labels in chunks:
            pending.append((labels, pool.apply_async(_encode_chunk, (texts, dtype))))
            if len(pending) >= 2 * workers:
                labels_, result = pending.popleft()
                yield labels_, _try(result.get)
        while pending:
            labels_, result = pending.popleft()
            yield labels_, _try(result.get)


@contextlib.contextmanager
def _default_sigterm():
    """SIGTERM's default action while the pool forks its workers: a worker that inherited the
    command's handler (fastlm.cli.prepare's, which raises) would outlive the pool's terminate()
    whenever it is not running Python code, and a parent waiting for it would hang."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers (and then the command's is not installed)
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _try(call) -> tuple | _EncodeError:
    try:
        return call()
    except _EncodeError as error:
        return error


def _fingerprint(
    tokenizer: Tokenizer,
    sources: list[dict],
    text_column: str,
    document_end: str,
    separator: str | None,
    skip_empty: bool,
) -> dict:
    """What the tokens depend on: a partial run resumes only when all of it is unchanged."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "sources": sources,
        "text_column": text_column,
        "document_end": document_end,
        "document_separator": separator,
        "skip_empty": skip_empty,
    }


def _write_json(path: Path, value: dict) -> None:
    """`value` in `path`, replaced whole (written beside it, flushed, renamed)."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    staging.rename(path)


def _names(paths: list[Path], limit: int = 3) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def prepare(
    data: str | os.PathLike | None,
    out: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    text_column: str = "text",
    val_fraction: float = 0.05,
    document_end: str = "\n",
    document_separator: str | None = None,
    workers: int = 1,
    overwrite: bool = False,
    skip_empty: bool = False,
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> dict:
    """Tokenize the corpus `data` into the cache folder `out` (the module docstring); its
    metadata. DataError for bad input (the corpus's, a full disk); an interrupted or failed run
    keeps `out.partial` to resume from."""
    from tqdm import tqdm

    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must lie in (0, 1), got {val_fraction}")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if document_separator == "":
        raise DataError("--document-separator must not be empty")
    tokenizer = load_tokenizer(tokenizer_path)
    check_marker(tokenizer, document_end, "--document-end")
    tokenizer_path = None if tokenizer_path is None else str(tokenizer_path)
    if data is not None:  # None: the default corpus, as fastlm-train's
        if is_cache(data):
            raise DataError(f"--data {data} is already prepared: pass it to fastlm-train --data")
        check_not_partial(data)
    note = lossy_note(tokenizer)
    if note:
        say(note)
    out = Path(out)
    staging = out.with_name(out.name + PARTIAL)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder: choose another --out")
    # OUT (and OUT.partial) may lie inside DATA: they are no text of the corpus.
    reading = Reading(skip_empty=skip_empty)
    found = corpus_sources(data, (out, staging), reading, text_column)
    if overwrite and out.exists():
        inputs = [("--data", source.path) for source in found]
        if tokenizer_path is not None:
            inputs.append(("--tokenizer", tokenizer_path))
        check_spares_inputs(out, "--out", inputs, DataError)
    fingerprint = _fingerprint(
        tokenizer, corpus.stats(found), text_column, document_end, document_separator, skip_empty
    )
    if out.exists() and not overwrite:
        if is_cache(out):
            meta = read_metadata(out)
            recorded = {key: meta.get(key) for key in fingerprint}
            if recorded == fingerprint and meta.get("val_fraction") == val_fraction:
                say(f"fastlm-prepare: {out} already holds this corpus, prepared")
                return meta
            if recorded == fingerprint:
                raise DataError(
                    f"{out} holds this corpus prepared with --val-fraction "
                    f"{meta.get('val_fraction')}, not {val_fraction}: pass --overwrite to "
                    "prepare it again, or another --out"
                )
        if is_cache(out) or any(out.iterdir()):
            raise DataError(
                f"{out} already holds "
                + ("another prepared corpus" if is_cache(out) else "other files")
                + ": pass --overwrite to replace it, or another --out"
            )
    done = {"documents": 0, "tokens": 0, "starts": 0}
    saved = staging / PROGRESS
    if saved.is_file():
        try:
            previous = json.loads(saved.read_text())
        except (OSError, json.JSONDecodeError):
            previous = {}
        if previous.get("fingerprint") == fingerprint:
            done = previous["done"]
            say(
                f"fastlm-prepare: resuming {staging}: {done['documents']:,} documents "
                f"({done['tokens']:,} tokens) already tokenized"
            )
        else:
            say(f"fastlm-prepare: {staging} is from other sources or options: starting afresh")
    if done["documents"] == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tokens_path, starts_path = staging / TOKENS, staging / DOCUMENTS

    def cannot_write(path: Path, error: OSError) -> DataError:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        kept = (
            f"the {done['documents']:,} documents tokenized so far stay in {staging}; "
            if done["documents"]
            else ""
        )
        return DataError(
            f"cannot write {path} ({error.strerror or error}): {kept}"
            + ("free some space" if full else "fix that")
            + " and run the same command again"
            + (" to resume" if kept else "")
        )

    try:
        staging.mkdir(parents=True, exist_ok=True)
        for path, count, item in ((tokens_path, done["tokens"], dtype.itemsize),
                                  (starts_path, done["starts"], 8)):  # fmt: skip
            path.touch()
            os.truncate(path, count * item)  # what a crash wrote past the last progress record
    except OSError as error:
        raise cannot_write(staging, error) from None

    skip, found_text = done["documents"], [False]
    sizes = [row["size"] for row in fingerprint["sources"]]
    chunks = _chunks(
        found, text_column, reading, document_end, document_separator, skip, found_text, sizes
    )
    # Progress in the sources' bytes read (compressed ones as stored), which have a known total
    # (documents do not): tqdm then shows a rate and an ETA.
    bar = tqdm(
        desc="tokenizing",
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=not progress or not sys.stderr.isatty(),
    )
    shown = 0
    try:
        with open(tokens_path, "ab") as tokens_file, open(starts_path, "ab") as starts_file:
            for (labels, read), result in _in_order(chunks, workers, tokenizer_path, dtype):
                if isinstance(result, _EncodeError):
                    raise DataError(f"{labels[result.position]}: {result.reason}")
                ids, lengths = result
                offsets = done["tokens"] + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                starts = offsets[lengths > 0].astype(np.int64)
                try:
                    for file, array, path in ((tokens_file, ids, tokens_path),
                                              (starts_file, starts, starts_path)):  # fmt: skip
                        write_array(file, array, path)
                except OSError as error:
                    raise cannot_write(path, error) from None
                done = {
                    "documents": done["documents"] + len(lengths),
                    "tokens": done["tokens"] + len(ids),
                    "starts": done["starts"] + len(starts),
                }
                try:
                    _write_json(saved, {"fingerprint": fingerprint, "done": done})
                except OSError as error:
                    raise cannot_write(saved, error) from None
                bar.update(read - shown)  # (a disabled bar keeps no count of its own)
                shown = read
                bar.set_postfix(
                    documents=f"{done['documents']:,}", tokens=f"{done['tokens']:,}", refresh=False
                )
    except BaseException:
        if done["documents"] == 0:  # nothing to resume from: leave no empty OUT.partial
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
    for line in corpus.notes(reading):
        say(line)
    if not found_text[0]:  # no documents, or only empty ones (as fastlm-train's check)
        shutil.rmtree(staging, ignore_errors=True)
        skipped = (
            f" (skipped as binary, with NUL bytes: {_names(reading.skipped)})"
            if reading.skipped
            else ""
        )
        raise DataError(f"the corpus at {data} is empty{skipped}")
    n_val = int(done["tokens"] * val_fraction)
    meta = {
        "format": FORMAT,
        **fingerprint,
        "fastlm_version": fastlm.__version__,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "tokens": done["tokens"],
        "train_tokens": done["tokens"] - n_val,
        "documents": done["starts"],
        "val_fraction": val_fraction,
        "skipped": [str(p) for p in reading.skipped],
        "left_out": [str(p) for p in reading.left_out],
        "empty_records": reading.empty_records,
    }
    try:
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, staging / TOKENIZER)
        _write_json(staging / METADATA, meta)
        saved.unlink()
        if out.exists():  # --overwrite
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except OSError as error:
        raise cannot_write(out, error) from None
    return meta


def write_array(file, array: np.ndarray, path: Path) -> None:
    """Append `array`'s bytes to `file` and flush them to disk (`path` names it in errors)."""
    file.write(array.tobytes())
    file.flush()
    os.fsync(file.fileno())
