"""The training command's tokens and batches: the corpus read and tokenized, or a prepared cache
memory-mapped, split by rank, and drawn into batches.

- The default corpus is the Python standard library's own source: every Python installation ships
  it, so `fastlm-train` needs no download. A deterministic subset (top-level `.py` files
  in name order, up to `fastlm.corpus.DEFAULT_CORPUS_BYTES`) keeps the run short.
- The tokenizers (`ByteTokenizer`, the default, and a Hugging Face `tokenizer.json`) are in
  `fastlm.tokens`.
- Under torchrun each rank reads its own contiguous shard of the text, tokenizes only that, and
  keeps the shard's last `val_fraction` as its held-out part.
- Batches are a pure function of (seed, rank, step, micro-step): a resumed run draws exactly the
  batches the uninterrupted run would have drawn, with no sampler state to save.
- `--data` is read by `fastlm.corpus`: text files, Parquet, JSON Lines or a `datasets` folder;
  a folder written by `fastlm-prepare` (`fastlm.token_cache`) is memory-mapped instead. A corpus
  is tokenized document by document as its records are read (only the tokens are kept: the
  whole text and one huge encoding of it took several times the corpus's size in memory).
- Packed documents (`--pack-documents`): each corpus file (or record) is a document (and, with
  `--document-separator TEXT`, each stretch of text that ends with TEXT). Its text is tokenized
  on its own, its start recorded, and a batch then carries cu_seqlens that split its windows
  at those starts (and at each row's start), so that attention and positions stay within a
  document; the target that would predict the next document's first token is ignored.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from fastlm import corpus, token_cache
from fastlm.corpus import DataError, Reading, corpus_sources
from fastlm.tokens import Tokenizer, TokenSplit, check_long_enough

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """The text of the corpus's documents, and what reading its text files skipped or repaired."""

    text: str
    starts: list[int]  # where each document's text begins in `text`
    reading: Reading  # what reading skipped (binary files), left out or repaired


def read_corpus(
    data: str | os.PathLike | None,
    text_column: str = "text",
    exclude: tuple[str | os.PathLike, ...] = (),
    skip_empty: bool = False,
) -> Corpus:
    """The documents of `--data` (a text file each, or a record each; `fastlm.corpus`) joined
    by newlines, in memory; files in the folders `exclude` are left out, and with skip_empty
    records of null or empty text. (`load_split` streams them instead: `_pieces`.)"""
    reading = Reading(skip_empty=skip_empty)
    found = corpus_sources(data, exclude, reading, text_column)
    parts = list(_pieces(found, text_column, reading))
    starts = [0, *itertools.accumulate(len(part) for part in parts)][: len(parts)]
    return Corpus("".join(parts), starts, reading)


def _pieces(
    found: list[corpus.Source],
    text_column: str,
    reading: Reading,
    sizes: list[int] | None = None,
    advance: Callable[[int], object] | None = None,
) -> Iterator[str]:
    """The corpus's text as `read_corpus` joins it, one document at a time: each document with
    the newline that joins it to the next (the last one has none). `advance` gets the bytes of
    the sources (their `sizes`) read since its last call."""
    previous, before, told = None, 0, 0
    for source, size in zip(found, sizes or [0] * len(found)):
        for text in corpus.read_source(source, text_column, reading):
            if previous is not None:
                yield previous + "\n"
            previous = text
            if advance is not None:
                at = corpus.bytes_read(reading, before, size)
                advance(at - told)
                told = at
        before += size
    if advance is not None:
        advance(before - told)
    if previous is not None:
        yield previous


def _names(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def check_split_options(
    val_fraction: float, pack_documents: bool, document_separator: str | None
) -> None:
    """DataError for `load_split` options that do not go together, before any file is read.

    Args:
        val_fraction, pack_documents, document_separator: as `load_split` takes them.
    """
    if document_separator is not None and (not pack_documents or not document_separator):
        raise DataError("--document-separator needs --pack-documents and a non-empty TEXT")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must lie in (0, 1), got {val_fraction}")


def load_split(
    data: str | os.PathLike | None,
    tokenizer: Tokenizer,
    context_length: int,
    val_fraction: float,
    rank: int = 0,
    world_size: int = 1,
    warn: Callable[[str], None] | None = None,
    pack_documents: bool = False,
    document_separator: str | None = None,
    text_column: str = "text",
    exclude: tuple[str | os.PathLike, ...] = (),
    skip_empty: bool = False,
    progress: bool = False,
) -> TokenSplit:
    """Read the corpus, tokenize this rank's shard and split it into training and held-out tokens.

    Both parts must hold more than `context_length` tokens (one window plus its next token).
    `warn` receives a line for each file that is not valid UTF-8. pack_documents: tokenize each
    document (file) of the shard on its own and record where each begins; document_separator:
    a document also ends after each occurrence of this text (which stays its last token).
    text_column: the column or field of a Parquet, JSON Lines or `datasets` corpus.
    exclude: folders inside `data` that are none of its text (the run's checkpoint folder).
    skip_empty: skip records whose text is null or empty (counted in a note), not refuse them.
    progress: a corpus (not a cache) is tokenized under a progress bar on stderr, when it is a
    terminal: what is tokenized, from how many files, the bytes read against their total.

    A folder written by `fastlm-prepare` (`fastlm.token_cache`) is not read into memory: its
    parts are memory-mapped, and this rank's windows read from the file as batches need them.
    """
    check_split_options(val_fraction, pack_documents, document_separator)
    if data is not None:
        token_cache.check_not_partial(data)
    if data is not None and token_cache.is_cache(data):
        if document_separator is not None:
            raise DataError(
                "--document-separator is fastlm-prepare's option for a prepared corpus: its "
                "documents were split when it was tokenized"
            )
        return token_cache.load_split(
            data, tokenizer, context_length, rank, world_size, pack_documents, warn, val_fraction
        )
    reading = Reading(skip_empty=skip_empty)
    found = corpus_sources(data, exclude, reading, text_column)
    where = f"the corpus at {data}" if data else "the default corpus"
    first, end = 0, math.inf
    if world_size > 1:  # this rank's shard of the text's characters: a first pass counts them
        length = sum(map(len, _pieces(found, text_column, Reading(skip_empty=skip_empty))))
        shard = length // world_size
        first, end = rank * shard, (rank + 1) * shard
    separator = document_separator if pack_documents else None
    files = f"{len(found)} file" + ("s" if len(found) != 1 else "")
    sizes = [row["size"] for row in corpus.stats(found)]
    bar = tqdm(
        desc=f"tokenizing {where} ({files}) with {getattr(tokenizer, 'path', 'UTF-8 bytes')}",
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,  # an error after it stays one line
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=not progress or not sys.stderr.isatty(),
    )
    with bar:
        pieces = _pieces(found, text_column, reading, sizes, bar.update)
        tokens, starts, has_text = _encode_documents(tokenizer, pieces, first, end, separator)
    if warn is not None:
        for line in corpus.notes(reading):
            warn(line)
    if not has_text:
        skipped = (
            (
                f" (skipped as binary, with NUL bytes: {_names(reading.skipped)}; "
                "UTF-16 text must be converted to UTF-8)"
            )
            if reading.skipped
            else ""
        )
        raise DataError(f"{where} is empty{skipped}")
    if not pack_documents:
        starts = None
    n_val = int(len(tokens) * val_fraction)
    n_train = len(tokens) - n_val
    split = TokenSplit(train=tokens[:n_train], val=tokens[n_train:])
    if starts is not None:
        split.train_starts = starts[starts < n_train]
        split.val_starts = starts[starts >= n_train] - n_train
    check_long_enough(split, context_length, world_size, "the corpus")
    return split


def _encode_documents(
    tokenizer: Tokenizer, pieces: Iterator[str], first: int, end: float, separator: str | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Characters [first, end) of the text that `pieces` (the documents, `_pieces`) make up,
    tokenized as they are read, one document at a time (a document also ends after each
    `separator` in it): the tokens, the token positions where the documents that begin in the
    range begin (a shard may start inside a document), and whether any document holds more
    than whitespace. Only the tokens are kept, never the text."""
    kept, lengths, offset, has_text = [], [], 0, False
    for piece in pieces:
        has_text = has_text or (bool(piece) and not piece.isspace())
        a, b = max(offset, first), min(offset + len(piece), end)
        cuts = [a]
        if separator and a < b:
            ends = (offset + m.end() for m in re.finditer(re.escape(separator), piece))
            cuts += [e for e in ends if a < e < b]
        cuts.append(b)
        for x, y in zip(cuts, cuts[1:]):
            if x < y:
                kept.append(tokenizer.encode(piece[x - offset : y - offset]))
                lengths.append(len(kept[-1]))
        offset += len(piece)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    token_starts = lengths.cumsum(0) - lengths
    tokens = torch.cat(kept) if kept else torch.empty(0, dtype=torch.int32)
    return tokens, token_starts[lengths > 0], has_text


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def batch_at(
    tokens: torch.Tensor,
    context_length: int,
    offsets: torch.Tensor,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inputs and next-token targets [batch, context] starting at `offsets`, and with
    document_starts (packed documents) the batch's cu_seqlens (`pack`), else None."""
    index = offsets[:, None] + torch.arange(context_length + 1)  # (B, T + 1)
    window = tokens[index].long()
    inputs, targets = window[:, :-1], window[:, 1:]
    if document_starts is None:
        return inputs, targets, None
    return inputs, *pack(targets, offsets, document_starts)


IGNORE_INDEX = -100


def pack(
    targets: torch.Tensor, offsets: torch.Tensor, document_starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, cu_seqlens) for windows [batch, context] of the tokens at `offsets`: the B * T
    tokens, flattened row by row, split where a document begins inside a window and at each
    row's start (a window that starts inside a document takes its part as a document), as int32
    cu_seqlens; the targets that would predict a document's first token from the one before
    (the last target of the previous document) become IGNORE_INDEX."""
    B, T = targets.shape
    targets = targets.clone()
    bounds = [0]
    for row, offset in enumerate(offsets.tolist()):
        inside = document_starts[(document_starts > offset) & (document_starts <= offset + T)]
        for start in (inside - offset).tolist():
            targets[row, start - 1] = IGNORE_INDEX
            if start < T:
                bounds.append(row * T + start)
        bounds.append((row + 1) * T)
    return targets, torch.tensor(bounds, dtype=torch.int32)


def training_batch(
    tokens: torch.Tensor,
    batch_size: int,
    context_length: int,
    seed: int,
    rank: int,
    step: int,
    micro_step: int,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random windows of the training tokens, determined by (seed, rank, step, micro_step), as
    `batch_at` gives them."""
    # Hashes of int tuples do not depend on PYTHONHASHSEED, so every process draws the same.
    generator = torch.Generator().manual_seed(hash((seed, rank, step, micro_step)) & (2**63 - 1))
    offsets = torch.randint(0, len(tokens) - context_length, (batch_size,), generator=generator)
    return batch_at(tokens, context_length, offsets, document_starts)


def eval_batches(
    tokens: torch.Tensor,
    batch_size: int,
    context_length: int,
    num_batches: int,
    document_starts: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The same held-out windows every time, spread evenly over the held-out tokens."""
    count = batch_size * num_batches
    offsets = torch.linspace(0, len(tokens) - context_length - 1, count).long()
    return [
        batch_at(tokens, context_length, chunk, document_starts)
        for chunk in offsets.split(batch_size)
    ]
