"""Corpus, tokenizers and batches for the training command.

- The default corpus is the Python standard library's own source: every Python installation ships
  it, so `fastlm-train` needs no download. A deterministic subset (top-level `.py` files
  in name order, up to `DEFAULT_CORPUS_BYTES`) keeps the run short.
- `ByteTokenizer` (vocabulary 256, UTF-8 bytes) is the default; `load_tokenizer(path)` reads a
  Hugging Face `tokenizers` JSON file instead (the package is imported only then).
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

import codecs
import hashlib
import os
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm import corpus
from fastlm.corpus import DataError, Reading, Source

DEFAULT_CORPUS_BYTES = 2_000_000


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def _not_utf8(text: str, error: UnicodeEncodeError) -> str:
    """What in `text` has no UTF-8 form: a byte a surrogate escape stands for (how Python hands
    over the bytes of a command-line argument or file name that are not UTF-8), or a lone
    surrogate."""
    code = ord(text[error.start])
    if 0xDC80 <= code <= 0xDCFF:
        return f"byte 0x{code - 0xDC00:02x}, which is not UTF-8"
    return f"U+{code:04X}, a lone surrogate that no bytes encode"


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, no download, every text encodes, and so does
    a byte that is not UTF-8 standing in a text as its surrogate escape (os.fsdecode's form)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        try:
            data = text.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError as error:
            raise DataError(f"the text holds {_not_utf8(text, error)}") from None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer needs the `tokenizers` package: pip install tokenizers"
            ) from None
        self.path = Path(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as error:  # the library raises bare Exceptions for unreadable files
            raise DataError(f"cannot read tokenizer {self.path}: {error}") from None
        # The file's digest names the tokenizer, so a checkpoint records exactly which one it used.
        self.name = "hf-" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> torch.Tensor:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise DataError(
                f"the text holds {_not_utf8(text, error)}: a tokenizer.json tokenizer takes text "
                "only (the byte tokenizer, a model trained without --tokenizer, takes any bytes)"
            ) from None
        return torch.tensor(self._tokenizer.encode(text).ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def stream_decoder(self) -> StreamDecoder:
        return _PrefixStreamDecoder(self)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """The byte tokenizer for `None`, else the Hugging Face tokenizer JSON at `path`."""
    if path is None:
        return ByteTokenizer()
    if not Path(path).is_file():
        raise DataError(f"tokenizer file not found: {path}")
    return HFTokenizer(path)


class StreamDecoder:
    """Turns token ids arriving one at a time into text, never splitting a character."""

    def push(self, token_id: int) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        return ""


class _ByteStreamDecoder(StreamDecoder):
    # An incremental UTF-8 decoder holds back the first bytes of a multibyte character until
    # the rest arrive, and replaces bytes that can never form one.
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _PrefixStreamDecoder(StreamDecoder):
    # Subword decoders merge pieces (spaces, byte fallbacks), so decode everything and emit what
    # is new; a trailing U+FFFD is an unfinished character and waits for the next token.
    def __init__(self, tokenizer: HFTokenizer):
        self._tokenizer, self._ids, self._emitted = tokenizer, [], 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        new, self._emitted = text[self._emitted :], len(text)
        return new


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


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


def corpus_sources(data: str | os.PathLike | None) -> list[Source]:
    """The sources of `--data` (`fastlm.corpus.sources`), or the default corpus's files."""
    if data is None:
        return [Source(path, "text") for path in default_corpus_files()]
    return corpus.sources(data)


@dataclass
class Corpus:
    """The text of the corpus's documents, and what reading its text files skipped or repaired."""

    text: str
    skipped: list[Path]  # binary files (a NUL byte: also UTF-16 and UTF-32 text)
    replaced: dict[Path, int]  # files that are not valid UTF-8: bytes replaced by U+FFFD
    starts: list[int]  # where each document's text begins in `text`


def read_corpus(data: str | os.PathLike | None, text_column: str = "text") -> Corpus:
    """The documents of `--data` (a text file each, or a record each; `fastlm.corpus`) joined
    by newlines, in memory."""
    reading = Reading()
    parts = list(corpus.documents(corpus_sources(data), text_column, reading))
    starts, offset = [], 0
    for part in parts:
        starts.append(offset)
        offset += len(part) + 1  # the newline that joins it to the next
    return Corpus("\n".join(parts), reading.skipped, reading.replaced, starts)


def _names(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


@dataclass
class TokenSplit:
    """One rank's training and held-out tokens (uint8 for bytes, int32 for subwords)."""

    train: torch.Tensor
    val: torch.Tensor
    # With pack_documents: the token positions where documents begin in each part (int64).
    train_starts: torch.Tensor | None = None
    val_starts: torch.Tensor | None = None


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
) -> TokenSplit:
    """Read the corpus, tokenize this rank's shard and split it into training and held-out tokens.

    Both parts must hold more than `context_length` tokens (one window plus its next token).
    `warn` receives a line for each file that is not valid UTF-8. pack_documents: tokenize each
    document (file) of the shard on its own and record where each begins; document_separator:
    a document also ends after each occurrence of this text (which stays its last token).
    text_column: the column or field of a Parquet, JSON Lines or `datasets` corpus.

    A folder written by `fastlm-prepare` (`fastlm.token_cache`) is not read into memory: its
    parts are memory-mapped, and this rank's windows read from the file as batches need them.
    """
    check_split_options(val_fraction, pack_documents, document_separator)
    from fastlm import token_cache  # it builds on this module

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
    text_corpus = read_corpus(data, text_column)
    for path, count in text_corpus.replaced.items():
        if warn is not None:
            warn(
                f"warning: {path} is not valid UTF-8: {count} undecodable bytes replaced by U+FFFD"
            )
    text = text_corpus.text
    if not text.strip():
        where = f"the corpus at {data}" if data else "the default corpus"
        skipped = (
            (
                f" (skipped as binary, with NUL bytes: {_names(text_corpus.skipped)}; UTF-16 text "
                "must be converted to UTF-8)"
            )
            if text_corpus.skipped
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


def check_long_enough(
    split: TokenSplit, context_length: int, world_size: int, corpus_name: str
) -> None:
    """DataError unless both parts of this rank's split hold more than `context_length` tokens
    (one window plus its next token)."""
    if min(len(split.train), len(split.val)) <= context_length:
        per_rank = f" per rank ({world_size} ranks)" if world_size > 1 else ""
        raise DataError(
            f"{corpus_name} is too small: {len(split.train) + len(split.val)} tokens{per_rank}, "
            f"split {len(split.train)}/{len(split.val)} for training/held-out, but each part "
            f"needs more than --context-length={context_length}"
        )


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
