"""Tokenizers, and the training and held-out tokens a rank trains on.

- `ByteTokenizer` (vocabulary 256, UTF-8 bytes) is the default; `load_tokenizer(path)` reads a
  Hugging Face `tokenizers` JSON file instead (the package is imported only then).
- Each tokenizer has a `stream_decoder()` that turns ids arriving one at a time into text
  (`fastlm-generate` streams with it).
- `TokenSplit` is one rank's training and held-out tokens, read into memory (`fastlm.data`) or
  memory-mapped from a prepared cache (`fastlm.token_cache`); both check it with
  `check_long_enough`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.corpus import DataError

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


def _check_tokenizer_file(path: Path) -> None:
    """DataError, in words, for a file that is no `tokenizers` JSON (the library's own message
    for one is a JSON parser's: "expected `,` or `}` at line 1 column 5")."""
    try:
        content = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(
            f"--tokenizer {path} is not a Hugging Face tokenizer file: not JSON ({error})"
        ) from None
    if not isinstance(content, dict) or "model" not in content:
        raise DataError(
            f"--tokenizer {path} is JSON but not a Hugging Face tokenizer file (a tokenizer.json "
            'has a "model", saved by the tokenizers library or a fast tokenizer)'
        )


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
        _check_tokenizer_file(self.path)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as error:  # the library raises bare Exceptions for unreadable files
            raise DataError(f"cannot read tokenizer {self.path}: {error}") from None
        # The file's digest names the tokenizer, so a checkpoint records exactly which one it used.
        self.name = "hf-" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        # The ids the model must cover: up to the largest one, which may lie past
        # get_vocab_size() (the count of tokens) where the vocabulary's ids have gaps.
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids, default=-1) + 1

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

    def special_tokens(self) -> list:
        """The tokenizer's special added tokens (AddedToken objects), in id order."""
        added = self._tokenizer.get_added_tokens_decoder()
        return [added[i] for i in sorted(added) if added[i].special]

    def token_id(self, text: str) -> int | None:
        """The id of the token `text` (a special token such as "<|endoftext|>"), or None."""
        return self._tokenizer.token_to_id(text)


Tokenizer = ByteTokenizer | HFTokenizer

#: What tokenizers name their end-of-text and beginning-of-text tokens, in the order looked for.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BEGIN_OF_TEXT = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|bos|>", "[BOS]")


#: Text a tokenizer should give back as it is (and an export's tokenizer encode as the run's).
PROBE = "The quick brown fox, 2 + 2 = 4.\n\tdef f(x):  return x  # ça, 速い!"

# What --document-end looks like when it means a special token: <|endoftext|>, </s>, [SEP].
_MARKER = re.compile(r"<[^<>\s]+>|\[[A-Za-z_]+\]")


def lossy_note(tokenizer: Tokenizer) -> str | None:
    """A warning when the tokenizer does not give back the text it encodes (a WordPiece that
    lowercases and has [UNK], a BPE without a decoder): its samples will not read as the
    corpus. None for one that does."""
    if isinstance(tokenizer, ByteTokenizer):
        return None
    decoded = tokenizer.decode(tokenizer.encode(PROBE).tolist())
    if decoded == PROBE:
        return None
    return (
        f"warning: the tokenizer {tokenizer.path} does not give back the text it encodes "
        f"({PROBE!r} decodes as {decoded!r}): generated text will not read as the corpus does"
    )


def check_marker(tokenizer: Tokenizer, text: str, flag: str) -> None:
    """DataError when `text` looks like a special token (<|endoftext|>, </s>, [SEP]) that the
    tokenizer does not have: it would silently become several ordinary tokens."""
    if not isinstance(tokenizer, HFTokenizer) or not _MARKER.fullmatch(text):
        return
    if tokenizer.token_id(text) is not None:
        return
    count = len(tokenizer.encode(text))
    special = [t.content for t in tokenizer.special_tokens()][:6]
    raise DataError(
        f"{flag} {text!r} is no token of the tokenizer {tokenizer.path}: it would become "
        f"{count} ordinary tokens; pass a token it has"
        + (f" ({', '.join(special)})" if special else " (it has no special tokens)")
        + " or plain text"
    )


def special_token(
    tokenizer: Tokenizer, names: tuple[str, ...], chosen: str | None = None
) -> tuple[str, int] | None:
    """(text, id) of the first of `names` the tokenizer has as one token, or of `chosen` when
    given (DataError if it is not one token); None for none (and for the byte tokenizer, whose
    ids are bytes: no token ends a text)."""
    if chosen is not None:
        found = tokenizer.token_id(chosen) if isinstance(tokenizer, HFTokenizer) else None
        if found is None:
            raise DataError(f"the tokenizer has no token {chosen!r}")
        return chosen, found
    if isinstance(tokenizer, ByteTokenizer):
        return None
    for name in names:
        found = tokenizer.token_id(name)
        if found is not None:
            return name, found
    return None


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
# Token splits
# --------------------------------------------------------------------------------------------


@dataclass
class TokenSplit:
    """One rank's training and held-out tokens (uint8 for bytes, int32 for subwords)."""

    train: torch.Tensor
    val: torch.Tensor
    # With pack_documents: the token positions where documents begin in each part (int64).
    train_starts: torch.Tensor | None = None
    val_starts: torch.Tensor | None = None


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
