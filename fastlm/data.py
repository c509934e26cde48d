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
  a folder written by `fastlm-prepare` (`fastlm.token_cache`) is memory-mapped instead.
- Packed documents (`--pack-documents`): each corpus file (or record) is a document (and, with
  `--document-separator TEXT`, each stretch of text that ends with TEXT). Its text is tokenized
  on its own, its start recorded, and a batch then carries cu_seqlens that split its windows
  at those starts (and at each row's start), so that attention and positions stay within a
  document; the target that would predict the next document's first token is ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

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
    records of null or empty text."""
    reading = Reading(skip_empty=skip_empty)
    found = corpus_sources(data, exclude, reading, text_column)
    parts = list(corpus.documents(found, text_column, reading))
    starts, offset = [], 0
    for part in parts:
        starts.append(offset)
        offset += len(part) + 1  # the newline that joins it to the next
    return Corpus("\n".join(parts), starts, reading)


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
) -> TokenSplit:
    """Read the corpus, tokenize this rank's shard and split it into training and held-out tokens.

    Both parts must hold more than `context_length` tokens (one window plus its next token).
    `warn` receives a line for each file that is not valid UTF-8. pack_documents: tokenize each
    document (file) of the shard on its own and record where each begins; document_separator:
    a document also ends after each occurrence of this text (which stays its last token).
    text_column: the column or field of a Parquet, JSON Lines or `datasets` corpus.
    exclude: folders inside `data` that are none of its text (the run's checkpoint folder).
    skip_empty: skip records whose text is null or empty (counted in a note), not refuse them.

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
    text_corpus = read_corpus(data, text_column, exclude, skip_empty)
    if warn is not None:
        for line in corpus.notes(text_corpus.reading):
            warn(line)
    text = text_corpus.text
    if not text.strip():
        where = f"the corpus at {data}" if data else "the default corpus"
        skipped = (
            (
                f" (skipped as binary, with NUL bytes: {_names(text_corpus.reading.skipped)}; "
                "UTF-16 text must be converted to UTF-8)"
            )
            if text_corpus.reading.skipped
            else ""
        )
        raise DataError(f"{where} is empty{skipped}")
    shard = len(text) // world_size
    first, end = rank * shard, (rank + 1) * shard
    if pack_documents:
        starts = text_corpus.starts
        if document_separator:
            ends = (m.end() for m in re.finditer(re.escape(document_separator), text))
            starts = sorted({*starts, *(e for e in ends if e < len(text))})
        tokens, starts = _encode_documents(tokenizer, text, starts, first, end)
    else:
        tokens, starts = tokenizer.encode(text[first:end]), None
    n_val = int(len(tokens) * val_fraction)
    n_train = len(tokens) - n_val
    split = TokenSplit(train=tokens[:n_train], val=tokens[n_train:])
    if starts is not None:
        split.train_starts = starts[starts < n_train]
        split.val_starts = starts[starts >= n_train] - n_train
    check_long_enough(split, context_length, world_size, "the corpus")
    return split


def _encode_documents(
    tokenizer: Tokenizer, text: str, starts: list[int], first: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """text[first:end] tokenized one document at a time, and the token positions where the
    documents that begin in it begin (a shard may start inside a document)."""
    cuts = [first, *(s for s in starts if first < s < end), end]
    pieces = [tokenizer.encode(text[a:b]) for a, b in zip(cuts, cuts[1:])]
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    token_starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    return torch.cat(pieces), token_starts[lengths > 0]


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
