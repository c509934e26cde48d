"""`fastlm-prepare` and training from its token cache: 2 workers write the bytes 1 does, an
interrupted or disk-full run resumes, training from the cache resumes exactly, each rank maps its
own shard, and a cache of another tokenizer or format version is refused."""

import contextlib
import errno
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fastlm.cli.prepare as prepare_cli
from fastlm import checkpoint, token_cache
from fastlm.data import DataError, load_split
from fastlm.tokens import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the quick brown fox jumps over lazy dog café 速い 茶色 狐 and then".split()


def make_corpus(folder, documents=120, seed=0):
    """Two Parquet shards of random sentences, a JSON Lines file and a text file: documents of
    mixed lengths, some of them multibyte."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)

    def sentence():
        return " ".join(rng.choice(WORDS, rng.integers(1, 60)))

    texts = [sentence() for _ in range(documents)]
    third = documents // 3
    pq.write_table(pa.table({"text": texts[:third]}), folder / "a.parquet", row_group_size=7)
    pq.write_table(pa.table({"text": texts[third : 2 * third]}), folder / "b.parquet")
    with open(folder / "c.jsonl", "w") as f:
        for text in texts[2 * third :]:
            f.write(json.dumps({"text": text}) + "\n")
    return texts


def prepare(argv, capsys):
    status = prepare_cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return status, json.loads(lines[-1]) if lines else None, captured.err


def digest(folder):
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in (token_cache.TOKENS, token_cache.DOCUMENTS)
    }


@pytest.fixture
def hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([" ".join(WORDS)], trainer)
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_two_workers_write_what_one_does(tmp_path, capsys, monkeypatch, hf_tokenizer, tokenizer):
    """The tokens are each document's own, with the document end appended, in corpus order;
    the offsets are where each begins; the metadata says what was read. Chunks small enough
    that each worker gets several."""
    monkeypatch.setattr(token_cache, "CHUNK_CHARS", 500)
    texts = make_corpus(tmp_path / "corpus")
    extra = [] if tokenizer == "bytes" else ["--tokenizer", hf_tokenizer]
    base = ["--data", tmp_path / "corpus", "--no-progress", *extra]
    status, one, err = prepare([*base, "--out", tmp_path / "one", "--workers", "1"], capsys)
    assert status == 0, err
    status, two, err = prepare([*base, "--out", tmp_path / "two", "--workers", "2"], capsys)
    assert status == 0, err
    assert digest(tmp_path / "one") == digest(tmp_path / "two")

    encoder = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(hf_tokenizer)
    pieces = [encoder.encode(text + "\n").numpy() for text in texts]
    tokens = np.fromfile(tmp_path / "one" / token_cache.TOKENS, dtype=np.uint16)
    assert np.array_equal(tokens, np.concatenate(pieces))
    starts = np.fromfile(tmp_path / "one" / token_cache.DOCUMENTS, dtype=np.int64)
    assert starts.tolist() == np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()

    meta = token_cache.read_metadata(tmp_path / "one")
    assert meta["tokens"] == len(tokens) and meta["documents"] == len(texts)
    assert meta["train_tokens"] == len(tokens) - int(len(tokens) * 0.05)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == encoder.name
    names = [s["path"].rsplit("/", 1)[-1] for s in meta["sources"]]
    assert names == ["a.parquet", "b.parquet", "c.jsonl"]
    for source in meta["sources"]:
        stat = (tmp_path / "corpus" / source["path"].rsplit("/", 1)[-1]).stat()
        assert (source["size"], source["mtime"]) == (stat.st_size, stat.st_mtime)
    assert meta["fastlm_version"] and meta["format_version"] == token_cache.FORMAT_VERSION
    assert (tmp_path / "one" / "tokenizer.json").is_file() == (tokenizer == "hf")
    assert one["tokens"] == two["tokens"] == len(tokens)


def test_token_width():
    assert token_cache.token_dtype(256) == np.uint16
    assert token_cache.token_dtype(65536) == np.uint16
    assert token_cache.token_dtype(65537) == np.uint32  # say Llama 3's 128256


def test_tokenizer_ids_past_its_vocabulary_size(tmp_path, capsys):
    """A vocabulary whose ids have a gap (3 tokens, one of them id 70000): the cache holds the
    ids whole (uint32, where 16 bits cut 70000 to 4464), fastlm-train trains on it, and a cache
    an earlier fastlm wrote with 16 bits is refused in one line."""
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"the": 0, "fox": 1, "[UNK]": 70000}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "gap.json"))
    assert tokenizer.get_vocab_size() == 3
    (tmp_path / "c.txt").write_text("the fox jumps " * 400)
    argv = ["--data", tmp_path / "c.txt", "--tokenizer", tmp_path / "gap.json", "--no-progress"]
    status, summary, err = prepare([*argv, "--out", tmp_path / "o", "--document-end", ""], capsys)
    assert status == 0 and summary["dtype"] == "uint32" and summary["vocab_size"] == 70001, err
    tokens = np.fromfile(tmp_path / "o" / token_cache.TOKENS, dtype=np.uint32)
    assert tokens[:3].tolist() == [0, 1, 70000]
    from test_train import TOY, run_main

    args = ["--data", tmp_path / "o", "--tokenizer", tmp_path / "gap.json", *TOY, "--steps", "1"]
    status, _, err = run_main([*args, "--out", tmp_path / "run"], capsys)
    assert status == 0, err
    meta_path = tmp_path / "o" / token_cache.METADATA
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "vocab_size": 3, "dtype": "uint16"}))
    (tmp_path / "o" / token_cache.TOKENS).write_bytes(tokens.astype(np.uint16).tobytes())
    status, _, err = run_main([*args, "--out", tmp_path / "run2"], capsys)
    last = err.strip().splitlines()[-1]  # after the tokenizer's warning: it gives no spaces back
    assert status == 2 and "Traceback" not in err, err
    assert last.startswith("fastlm-train: error: ") and last.endswith("prepare it again"), err


def test_out_inside_data_is_no_source(tmp_path, capsys):
    """--out inside --data: the rerun finds it prepared, and --overwrite tokenizes the corpus
    again, not the old cache's files (the tokens of a cache written elsewhere)."""
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "corpus" / name).write_text(f"the text of {name}\n" * 50)
    base = ["--data", tmp_path / "corpus", "--no-progress"]
    assert prepare([*base, "--out", tmp_path / "elsewhere"], capsys)[0] == 0
    inside = ["--out", tmp_path / "corpus" / "cache"]
    status, summary, err = prepare([*base, *inside], capsys)
    assert status == 0 and summary["sources"] == 2, err
    status, _, err = prepare([*base, *inside], capsys)
    assert status == 0 and "already holds this corpus" in err
    status, summary, err = prepare([*base, *inside, "--overwrite"], capsys)
    assert status == 0 and summary["sources"] == 2, err
    assert digest(tmp_path / "corpus" / "cache") == digest(tmp_path / "elsewhere")


def test_overwrite_never_deletes_an_input(tmp_path, capsys, hf_tokenizer):
    """--overwrite refuses an --out that is or holds what the command reads (the corpus's own
    folder, the tokenizer copy inside a cache), in one line, every file kept."""
    make_corpus(tmp_path / "corpus")
    before = sorted(p.name for p in (tmp_path / "corpus").iterdir())
    argv = ["--data", tmp_path / "corpus", "--out", tmp_path / "corpus", "--overwrite"]
    status, _, err = prepare(argv, capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert f"--out {tmp_path / 'corpus'} holds --data {tmp_path / 'corpus' / 'a.parquet'}" in err
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == before
    base = ["--data", tmp_path / "corpus", "--out", tmp_path / "o"]
    assert prepare([*base, "--tokenizer", hf_tokenizer], capsys)[0] == 0
    copy = tmp_path / "o" / token_cache.TOKENIZER
    status, _, err = prepare([*base, "--tokenizer", copy, "--overwrite"], capsys)
    assert status == 2 and f"holds --tokenizer {copy}, which this command reads" in err, err
    assert copy.is_file() and token_cache.is_cache(tmp_path / "o")


def test_tokenizer_mistakes_are_named(tmp_path, capsys, hf_tokenizer):
    """A JSON file that is no tokenizer, a --document-end the tokenizer lacks (it would become
    several ordinary tokens): one line each; a tokenizer that does not give back its text
    (WordLevel with no decoder: spaces lost) is accepted with a warning."""
    make_corpus(tmp_path / "corpus")
    base = ["--data", tmp_path / "corpus", "--no-progress"]
    (tmp_path / "config.json").write_text('{"vocab_size": 3}')
    (tmp_path / "notes.json").write_text("{'a': 1}")
    cases = {
        "config.json": "is JSON but not a Hugging Face tokenizer file",
        "notes.json": "is not a Hugging Face tokenizer file: not JSON",
    }
    for name, reason in cases.items():
        argv = [*base, "--tokenizer", tmp_path / name, "--out", tmp_path / "o"]
        status, _, err = prepare(argv, capsys)
        assert status == 2 and err.count("\n") == 1, err
        assert f"--tokenizer {tmp_path / name} {reason}" in err, err
    argv = [*base, "--tokenizer", hf_tokenizer, "--out", tmp_path / "o"]
    status, _, err = prepare([*argv, "--document-end", "<|endoftext|>"], capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "--document-end '<|endoftext|>' is no token of the tokenizer" in err
    assert "pass a token it has ([UNK])" in err and not (tmp_path / "o").exists()
    status, _, err = prepare(argv, capsys)
    assert status == 0 and "does not give back the text it encodes" in err, err


def test_training_from_a_cache_uses_its_tokenizer_copy(tmp_path, capsys, hf_tokenizer):
    from test_train import TOY, run_main

    make_corpus(tmp_path / "corpus")
    argv = ["--data", tmp_path / "corpus", "--tokenizer", hf_tokenizer, "--out", tmp_path / "o"]
    assert prepare(argv, capsys)[0] == 0
    args = ["--data", tmp_path / "o", *TOY, "--steps", "1", "--out", tmp_path / "run"]
    status, _, err = run_main(args, capsys)
    assert status == 0 and f"note: tokenizer {tmp_path / 'o' / 'tokenizer.json'}" in err, err
    assert (
        checkpoint.load_config(tmp_path / "run")["tokenizer"] == load_tokenizer(hf_tokenizer).name
    )


# fastlm-prepare with chunks of a few documents, each taking a while: SIGTERM finds it mid-run.
SLOW_PREPARE = """
import sys, time
import fastlm.cli.prepare as cli
from fastlm import token_cache
token_cache.CHUNK_CHARS = 200
encode = token_cache._encode_chunk
def slow(*args):
    time.sleep(0.2)
    return encode(*args)
token_cache._encode_chunk = slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="finds the workers in /proc")
def test_sigterm_is_one_line_and_ends_every_worker(tmp_path):
    from test_train import SUBPROCESS_ENV

    make_corpus(tmp_path / "corpus", documents=300)
    out = tmp_path / "o"
    argv = ["--data", tmp_path / "corpus", "--out", out, "--workers", "2", "--no-progress"]
    command = [sys.executable, "-c", SLOW_PREPARE, *map(str, argv)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    progress = tmp_path / "o.partial" / token_cache.PROGRESS
    deadline = time.monotonic() + 120
    while not progress.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines() == [
        f"fastlm-prepare: terminated: what is tokenized stays in {out}.partial; the same "
        "command resumes"
    ]
    alive = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if str(out).encode() in (entry / "cmdline").read_bytes():
                alive.append(entry.name)
    assert alive == []


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    (tmp_path / "taken").write_text("mine")
    for extra in ([], ["--overwrite"]):
        argv = ["--data", tmp_path / "corpus", "--out", tmp_path / "taken", *extra]
        status, _, err = prepare(argv, capsys)
        message = f"--out {tmp_path / 'taken'} is a file, not a folder: choose another --out"
        assert status == 2 and err == f"fastlm-prepare: error: {message}\n"
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("failure", ["interrupt", "full disk", "crash"])
def test_interrupted_prepare_resumes(tmp_path, capsys, monkeypatch, failure):
    """Ctrl-C, a full disk or a crash after a few chunks keeps DIR.partial and writes no DIR;
    the same command then tokenizes only the rest and writes the very bytes of an
    uninterrupted run."""
    monkeypatch.setattr(token_cache, "CHUNK_CHARS", 400)
    make_corpus(tmp_path / "corpus")
    base = ["--data", tmp_path / "corpus", "--no-progress", "--workers", "1"]
    status, _, err = prepare([*base, "--out", tmp_path / "whole"], capsys)
    assert status == 0, err

    write, calls = token_cache.write_array, []

    def failing_write(file, array, path):
        calls.append(path)
        if len(calls) == 7:  # the 4th chunk's tokens: 3 chunks are recorded
            if failure == "interrupt":
                raise KeyboardInterrupt
            if failure == "full disk":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            file.write(b"\x01\x02\x03")  # a crash in the middle of a write: bytes, no record
            raise SystemExit("killed")
        write(file, array, path)

    out = tmp_path / "cache"
    monkeypatch.setattr(token_cache, "write_array", failing_write)
    if failure == "crash":
        with pytest.raises(SystemExit):
            prepare([*base, "--out", out], capsys)
    else:
        status, _, err = prepare([*base, "--out", out], capsys)
        assert status == (130 if failure == "interrupt" else 2), err
        if failure == "full disk":
            assert err.count("\n") == 1 and "No space left on device" in err
            assert "run the same command again to resume" in err
    assert not out.exists() and (tmp_path / "cache.partial" / token_cache.PROGRESS).is_file()
    with pytest.raises(DataError, match="is an unfinished fastlm-prepare folder"):
        load_split(tmp_path / "cache.partial", ByteTokenizer(), 8, 0.05)
    monkeypatch.setattr(token_cache, "write_array", write)

    status, _, err = prepare([*base, "--out", out], capsys)
    assert status == 0, err
    assert "resuming" in err and "already tokenized" in err
    assert digest(out) == digest(tmp_path / "whole")
    assert not (tmp_path / "cache.partial").exists()
    total = json.loads((tmp_path / "whole" / token_cache.METADATA).read_text())
    assert json.loads((out / token_cache.METADATA).read_text()) == total


def test_resume_encodes_only_the_rest(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_CHARS", 400)
    make_corpus(tmp_path / "corpus")
    base = ["--data", tmp_path / "corpus", "--no-progress", "--workers", "1"]
    sizes = []
    encode = token_cache._encode_chunk

    def counting(texts, dtype):
        sizes.append(len(texts))
        if len(sizes) == 4:
            raise KeyboardInterrupt
        return encode(texts, dtype)

    monkeypatch.setattr(token_cache, "_encode_chunk", counting)
    status, _, _ = prepare([*base, "--out", tmp_path / "c"], capsys)
    assert status == 130
    first = sum(sizes[:3])
    sizes.clear()
    monkeypatch.setattr(token_cache, "_encode_chunk", encode)
    status, summary, err = prepare([*base, "--out", tmp_path / "c"], capsys)
    assert status == 0 and f"{first:,} documents" in err, err
    assert summary["documents"] == 120


def test_progress_bar_counts_bytes_of_a_known_total(tmp_path, capsys, monkeypatch):
    """The bar's total is the sources' bytes (so tqdm shows an ETA), and it moves within a
    source (a.parquet has row groups of 7 rows, chunks are a few documents) up to that total."""
    import tqdm

    monkeypatch.setattr(token_cache, "CHUNK_CHARS", 400)
    make_corpus(tmp_path / "corpus")
    bars = []

    class Spy(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = []
            bars.append(self)

        def update(self, n=1):  # a disabled bar (stderr is no terminal here) counts nothing
            super().update(n)
            self.seen.append((self.seen[-1] if self.seen else 0) + n)

    monkeypatch.setattr(tqdm, "tqdm", Spy)
    status, _, _ = prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "c"], capsys)
    assert status == 0
    (bar,) = bars
    total = sum(p.stat().st_size for p in (tmp_path / "corpus").iterdir())
    assert bar.total == total
    assert bar.seen == sorted(bar.seen) and bar.seen[-1] == total
    first = (tmp_path / "corpus" / "a.parquet").stat().st_size
    assert any(0 < n < first for n in bar.seen), bar.seen  # inside the first source


def test_bad_input_leaves_no_cache(tmp_path, capsys):
    """A missing column, a non-text record, an empty corpus: one line naming file and record,
    exit 2, no DIR (an empty corpus leaves no DIR.partial either)."""
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "c" / "a.parquet")
    status, _, err = prepare(["--data", tmp_path / "c", "--out", tmp_path / "o"], capsys)
    assert status == 2 and err.count("\n") == 1 and "a.parquet: no column 'text'" in err
    assert not (tmp_path / "o.partial").exists()  # nothing to resume: no empty files left
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "ok"}\n{"text": null}\n')
    status, _, err = prepare(["--data", tmp_path / "d", "--out", tmp_path / "o"], capsys)
    assert status == 2 and "a.jsonl, record 2: 'text' is null, not text" in err
    argv = ["--data", tmp_path / "d", "--out", tmp_path / "skipping", "--skip-empty"]
    status, summary, err = prepare(argv, capsys)
    assert status == 0 and summary["empty_records"] == 1 and summary["documents"] == 1, err
    assert "note: 1 records with null or empty text skipped" in err and "of 1 document in" in err
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.jsonl").write_text('{"text": ""}\n{"text": " \\n"}\n')
    pq.write_table(pa.table({"text": ["", "\t"]}), tmp_path / "e" / "b.parquet")
    status, _, err = prepare(["--data", tmp_path / "e", "--out", tmp_path / "o"], capsys)
    assert status == 2 and f"the corpus at {tmp_path / 'e'} is empty" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_prepared_out_is_reused_or_refused(tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    base = ["--data", tmp_path / "corpus", "--out", tmp_path / "o", "--no-progress"]
    assert prepare(base, capsys)[0] == 0
    status, _, err = prepare(base, capsys)
    assert status == 0 and "already holds this corpus" in err
    status, _, err = prepare(["--data", tmp_path / "o", "--out", tmp_path / "again"], capsys)
    assert status == 2 and "is already prepared: pass it to fastlm-train --data" in err
    status, _, err = prepare([*base, "--val-fraction", "0.1"], capsys)
    assert status == 2 and "holds this corpus prepared with --val-fraction 0.05, not 0.1" in err
    status, summary, err = prepare([*base, "--val-fraction", "0.1", "--overwrite"], capsys)
    assert status == 0 and summary["val_fraction"] == 0.1, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("x")
    status, _, err = prepare([*base[:2], "--out", tmp_path / "other"], capsys)
    assert status == 2 and "already holds other files" in err


def test_each_rank_maps_its_own_shard(tmp_path, capsys):
    """Data ranks split the training and the held-out parts evenly and contiguously; a shard is
    a view of the memory-mapped file, whose windows are read as batches need them."""
    make_corpus(tmp_path / "corpus", documents=300)
    assert prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "o"], capsys)[0] == 0
    meta = token_cache.read_metadata(tmp_path / "o")
    tokens = np.fromfile(tmp_path / "o" / token_cache.TOKENS, dtype=np.uint16)
    train, val = tokens[: meta["train_tokens"]], tokens[meta["train_tokens"] :]
    for world in (1, 3):
        for rank in range(world):
            split = load_split(tmp_path / "o", ByteTokenizer(), 8, 0.05, rank, world, None, True)
            assert isinstance(split.train.array, np.memmap)
            for part, whole, starts in ((split.train, train, split.train_starts),
                                        (split.val, val, split.val_starts)):  # fmt: skip
                size = len(whole) // world
                assert np.array_equal(part.array, whole[rank * size : (rank + 1) * size])
                assert len(starts) > 0 and starts.min() >= 0 and starts.max() < size
            window = split.train[torch.tensor([[0, 1, 2]])]
            assert window.dtype == torch.int64
            assert window.tolist() == [split.train.array[:3].tolist()]


def test_cache_of_another_tokenizer_or_version_is_refused(tmp_path, capsys, hf_tokenizer):
    make_corpus(tmp_path / "corpus")
    assert prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "o"], capsys)[0] == 0
    from test_train import TOY, run_main

    args = ["--data", tmp_path / "o", *TOY, "--steps", "1", "--out", tmp_path / "run"]
    status, _, err = run_main([*args, "--tokenizer", hf_tokenizer], capsys)
    assert status == 2 and "was tokenized with the byte tokenizer" in err, err
    meta_path = tmp_path / "o" / token_cache.METADATA
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    status, _, err = run_main(args, capsys)
    assert status == 2 and "prepared in format version 99" in err and "again" in err, err
    meta_path.write_text(json.dumps(meta))
    tokens = tmp_path / "o" / token_cache.TOKENS
    tokens.write_bytes(tokens.read_bytes()[:-2])
    status, _, err = run_main(args, capsys)
    assert status == 2 and "the cache is damaged" in err, err
    assert not (tmp_path / "run").exists()


def test_training_from_the_cache_resumes_exactly(tmp_path, capsys, monkeypatch):
    """Ctrl-C in step 5, --resume: the losses and weights of the uninterrupted run, bitwise,
    with documents packed from the cache's offsets."""
    from test_train import TOY, run_main, sigint_in_step

    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    make_corpus(tmp_path / "corpus", documents=300)
    assert prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "o"], capsys)[0] == 0
    args = ["--data", tmp_path / "o", *TOY, "--steps", "8", "--save-every", "3", "--pack-documents"]
    status, full, err = run_main([*args, "--out", tmp_path / "full"], capsys)
    assert status == 0 and full["targets_ignored"] > 0, err

    with sigint_in_step(5):
        status, part, err = run_main([*args, "--out", tmp_path / "split"], capsys)
    assert status == 130 and part["steps"] == 5, err
    status, _, err = run_main([*args, "--out", tmp_path / "split", "--resume"], capsys)
    assert status == 0, err
    expected, got = (checkpoint.load_state(tmp_path / n) for n in ("full", "split"))
    assert got["train_losses"] == expected["train_losses"]
    assert got["val_losses"] == expected["val_losses"]
    weights, expected_weights = (checkpoint.load_weights(tmp_path / n) for n in ("split", "full"))
    assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)


def test_stale_sources_are_noted(tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    assert prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "o"], capsys)[0] == 0
    with open(tmp_path / "corpus" / "c.jsonl", "a") as f:
        f.write(json.dumps({"text": "more"}) + "\n")
    notes = []
    load_split(tmp_path / "o", ByteTokenizer(), 8, 0.05, warn=notes.append)
    assert len(notes) == 1 and "1 of the sources" in notes[0] and "c.jsonl" in notes[0]
    notes.clear()
    load_split(tmp_path / "o", ByteTokenizer(), 8, 0.2, warn=notes.append)
    assert (
        "its last 0.05 (set by fastlm-prepare --val-fraction), not --val-fraction 0.2" in (notes[0])
    )
    with pytest.raises(DataError, match="too small"):
        load_split(tmp_path / "o", ByteTokenizer(), 10**6, 0.05)


def test_benchmark_runs_at_a_tiny_size(tmp_path, capsys):
    """benchmarks/prepare.py: its rows (1 and 2 workers, start-up from the cache and from the
    Parquet shards), the caches identical, CSV and JSON written."""
    import importlib.util
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.append(str(benchmarks))  # for its `_common`
    spec = importlib.util.spec_from_file_location("bench_prepare", benchmarks / "prepare.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--size-mb", "0.3", "--tokenizers", "bytes", "--workers", "2", "--out", str(tmp_path)]
    assert bench.main([*argv, "--work", str(tmp_path / "work")]) == 0
    rows = json.loads((tmp_path / "prepare.json").read_text())["rows"]
    assert [r["what"] for r in rows] == [
        "fastlm-prepare, 1 worker",
        "fastlm-prepare, 2 workers",
        "fastlm-train start-up, cache",
        "fastlm-train start-up, Parquet, tokenized at start",
    ]
    assert rows[1]["identical to 1 worker"] is True
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0.3 * 2**20
    assert all(r["1-step process s"] > 0 for r in rows[2:])
    assert (tmp_path / "prepare.csv").read_text().count("\n") == 5
    assert "| bytes | fastlm-prepare, 2 workers |" in capsys.readouterr().out


def test_torchrun_fsdp_from_the_cache_with_tensorboard(tmp_path, capsys):
    """Two ranks on gloo under FSDP2 train from the cache, each on its shard; rank 0 alone logs,
    and the gradient norm (a DTensor every rank reduces) reaches the event file."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_train import torchrun

    make_corpus(tmp_path / "corpus", documents=300)
    assert prepare(["--data", tmp_path / "corpus", "--out", tmp_path / "o"], capsys)[0] == 0
    logs = tmp_path / "logs"
    # torchrun's own parser refuses --log (an abbreviation of its options): --logger.
    extra = ["--model", "fastlm", "--fsdp", "--logger", "tensorboard", "--log-dir", str(logs)]
    result, _ = torchrun(tmp_path, tmp_path / "o", "fsdp", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert len(list(logs.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(logs))
    events.Reload()
    norms = [e.value for e in events.Scalars("train/grad_norm")]
    assert len(norms) == 4 and all(n > 0 for n in norms)


def test_document_separator_and_end(tmp_path, capsys):
    """--document-separator ends a document after each occurrence (which stays its last text);
    --document-end is appended to each document."""
    path = tmp_path / "many.txt"
    docs = ["first document. ", "second one. " * 2, "third. " * 3]
    path.write_text("<s>".join(docs) + "<s>")
    argv = ["--data", path, "--out", tmp_path / "o", "--document-separator", "<s>"]
    assert prepare([*argv, "--document-end", "|"], capsys)[0] == 0
    tokens = np.fromfile(tmp_path / "o" / token_cache.TOKENS, dtype=np.uint16)
    expected = "".join(d + "<s>|" for d in docs).encode()
    assert bytes(tokens.astype(np.uint8)) == expected
    starts = np.fromfile(tmp_path / "o" / token_cache.DOCUMENTS, dtype=np.int64)
    assert starts.tolist() == [0, len(docs[0]) + 4, len(docs[0]) + len(docs[1]) + 8]
