"""fastlm-prepare's throughput with 1 and N workers, and fastlm-train's start-up on its cache.

A corpus is generated (deterministic): Parquet shards (a `text` column, as FineWeb's) of documents
of log-normally spread lengths (median about 2 KB) made of words drawn from a Zipf-like
vocabulary, --size-mb of text in all (default 16; --full: 1024, the issue's 1 GB). For each
tokenizer (the byte tokenizer, and a byte-level BPE of --bpe-vocab tokens trained on the corpus's
first MBs with `tokenizers`), `fastlm.token_cache.prepare` runs with 1 worker and with --workers
(default: the CPUs), timed whole (reading Parquet, tokenizing, writing, flushing): tokens/s and
MB of text/s, and the two caches are compared byte for byte.

Start-up: the seconds `fastlm.data.load_split` takes to give the tiny preset's training split,
from the prepared cache (memory-mapped) against from the Parquet shards (read and tokenized at
start, as fastlm-train does without a cache), and the wall time of a whole `fastlm-train` process
that trains one step of a toy model, each way.

    python benchmarks/prepare.py                       # 16 MB, a minute or so on 2 cores
    python benchmarks/prepare.py --full --out results/ # 1 GB

Prints a table; with --out writes prepare.csv and prepare.json (rows and the environment).
Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as common  # first: this checkout's fastlm
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fastlm import token_cache
from fastlm.data import load_split
from fastlm.tokens import load_tokenizer

SHARD_MB = 64
TOY = ["--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--d-ff", "64"]
TOY += ["--context-length", "64", "--batch-size", "2", "--steps", "1", "--eval-batches", "1"]
TOY += ["--model", "reference", "--device", "cpu", "--no-progress"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=16.0, help="MB of generated text (16)")
    p.add_argument("--full", action="store_true", help="--size-mb 1024")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="N (the CPUs)")
    p.add_argument("--bpe-vocab", type=int, default=8192, help="the BPE's vocabulary (8192)")
    p.add_argument("--tokenizers", default="bytes,bpe", help="which rows (bytes,bpe)")
    p.add_argument("--work", type=Path, help="folder for the corpus and caches (a temporary one)")
    p.add_argument("--out", type=Path, metavar="DIR", help="write prepare.csv and prepare.json")
    args = p.parse_args(argv)
    if args.full:
        args.size_mb = 1024.0
    return args


def generate_corpus(folder: Path, size_mb: float, seed: int = 0) -> tuple[int, int]:
    """Parquet shards of `size_mb` MB of text in `folder`; (documents, bytes)."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "to", "ri", "an", "el", "mo", "su", "ve", "li", "qu", "or", "th", "é"]
    vocabulary = np.array(["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(5000)])
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)  # Zipf: a few words are most of them
    weights /= weights.sum()
    folder.mkdir(parents=True, exist_ok=True)
    target, total, documents, shard = int(size_mb * 2**20), 0, 0, 0
    while total < target:
        texts, shard_bytes = [], 0
        while shard_bytes < SHARD_MB * 2**20 and total + shard_bytes < target:
            words = rng.choice(vocabulary, int(rng.lognormal(5.8, 1.0)) + 1, p=weights)
            text = " ".join(words) + "."
            texts.append(text)
            shard_bytes += len(text.encode())
        pq.write_table(pa.table({"text": texts}), folder / f"{shard:03d}_00000.parquet")
        total, documents, shard = total + shard_bytes, documents + len(texts), shard + 1
    return documents, total


def train_bpe(corpus: Path, vocab_size: int, path: Path, sample_mb: float = 4.0) -> Path:
    """A byte-level BPE trained on the first `sample_mb` MB of the corpus, saved to `path`."""
    import tokenizers

    texts, size = [], 0
    for batch in pq.ParquetFile(sorted(corpus.glob("*.parquet"))[0]).iter_batches(1024):
        texts += batch.column(0).to_pylist()
        size = sum(len(t) for t in texts)
        if size > sample_mb * 2**20:
            break
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def time_prepare(corpus: Path, out: Path, tokenizer: Path | None, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    meta = token_cache.prepare(corpus, out, tokenizer, workers=workers, progress=False, say=str)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": meta["tokens"], "documents": meta["documents"]}


def time_start(data: Path, tokenizer: Path | None) -> dict:
    """load_split's seconds, and a one-step fastlm-train process's wall seconds, on `data`."""
    started = time.perf_counter()
    split = load_split(data, load_tokenizer(tokenizer), 64, 0.05)
    load_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as run:
        command = [sys.executable, "-m", "fastlm.cli.train", "--data", str(data), *TOY]
        command += ["--out", run, "--overwrite"]
        command += ["--tokenizer", str(tokenizer)] if tokenizer else []
        env = {**os.environ, "PYTHONPATH": str(common.REPO), "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        process_seconds = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(f"fastlm-train failed: {result.stderr[-2000:]}")
    return {
        "load_split_s": load_seconds,
        "train_process_s": process_seconds,
        "train_tokens": len(split.train),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="fastlm-prepare-bench-"))
    rows = []
    try:
        corpus = work / "corpus"
        documents, text_bytes = generate_corpus(corpus, args.size_mb)
        print(f"corpus: {documents:,} documents, {text_bytes / 2**20:,.1f} MB of text in {corpus}")
        for name in args.tokenizers.split(","):
            tokenizer = None
            if name == "bpe":
                tokenizer = train_bpe(corpus, args.bpe_vocab, work / "bpe.json")
            caches = {}
            for workers in dict.fromkeys((1, args.workers)):
                caches[workers] = work / f"cache-{name}-{workers}"
                timed = time_prepare(corpus, caches[workers], tokenizer, workers)
                rows.append(
                    {
                        "tokenizer": name,
                        "what": f"fastlm-prepare, {workers} worker{'s' * (workers > 1)}",
                        "workers": workers,
                        "seconds": round(timed["seconds"], 2),
                        "tokens": timed["tokens"],
                        "tokens/s": round(timed["tokens"] / timed["seconds"]),
                        "MB/s": round(text_bytes / 2**20 / timed["seconds"], 2),
                    }
                )
            files = [
                [(c / f).read_bytes() for f in (token_cache.TOKENS, token_cache.DOCUMENTS)]
                for c in caches.values()
            ]
            identical = all(f == files[0] for f in files)
            rows[-1]["identical to 1 worker"] = identical
            for label, data in (("cache", caches[1]), ("Parquet, tokenized at start", corpus)):
                started = time_start(data, tokenizer)
                rows.append(
                    {
                        "tokenizer": name,
                        "what": f"fastlm-train start-up, {label}",
                        "load_split s": round(started["load_split_s"], 4),
                        "1-step process s": round(started["train_process_s"], 2),
                    }
                )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    columns = list(dict.fromkeys(c for row in rows for c in row))
    print(common.markdown_table(rows, columns))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "prepare.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        record = {
            "size_mb": args.size_mb,
            "documents": documents,
            "text_bytes": text_bytes,
            "rows": rows,
            "environment": common.environment(),
        }
        (args.out / "prepare.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
