"""`--data` in the formats corpora come in: Parquet files and folders of shards, JSON Lines (plain,
gzip, zstandard), `datasets` save_to_disk folders; each record a document; one-line errors that
name the file and the record."""

import csv
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fastlm import corpus
from fastlm.data import DataError, load_split, read_corpus
from fastlm.tokens import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Größe, naïve café — 速い茶色の狐. " * 3,
    "",  # an empty record is an empty document
    "def f(x):\n    return x * 2\n" * 4,
    "last one " * 20,
]


def write_parquet(path, texts, column="text", row_group_size=2, **extra):
    table = pa.table({"id": list(range(len(texts))), column: texts, **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def joined(texts):
    return "\n".join(texts)


def test_parquet_file_and_folder_of_shards(tmp_path):
    """A Parquet file's rows are the documents, read in record batches; a folder of shards is
    read in name order, and its other files (a dataset card) are not part of the corpus."""
    one = write_parquet(tmp_path / "one.parquet", DOCS)
    read = read_corpus(one)
    assert read.text == joined(DOCS)
    assert read.starts == [sum(len(d) + 1 for d in DOCS[:i]) for i in range(len(DOCS))]

    shards = tmp_path / "fineweb" / "sample" / "10BT"
    shards.mkdir(parents=True)
    write_parquet(shards / "001_00000.parquet", DOCS[3:])
    write_parquet(shards / "000_00000.parquet", DOCS[:3])
    (tmp_path / "fineweb" / "README.md").write_text("---\nlicense: odc-by\n---\n# card")
    (tmp_path / "fineweb" / ".gitattributes").write_text("*.parquet filter=lfs")
    assert read_corpus(tmp_path / "fineweb").text == joined(DOCS)


def test_text_column_option(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", DOCS, column="content")
    assert read_corpus(path, text_column="content").text == joined(DOCS)
    with pytest.raises(DataError) as error:
        read_corpus(path)
    message = str(error.value)
    assert f"{path}: no column 'text'" in message and "'content'" in message
    assert "--text-column" in message and "\n" not in message


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.json.gz", "c.ndjson", "c.json.zst"])
def test_json_lines(tmp_path, name):
    rows = [{"text": d, "meta": {"n": i}} for i, d in enumerate(DOCS)]
    path = tmp_path / name
    if name.endswith(".zst"):
        zstandard = pytest.importorskip("zstandard")
        lines = "".join(json.dumps(row) + "\n" for row in rows).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        write_jsonl(path, rows, gzip.open if name.endswith(".gz") else open)
    assert corpus.kind_of(path) == "jsonl"
    assert read_corpus(path).text == joined(DOCS)


def test_plain_json_and_text_files_stay_text(tmp_path):
    (tmp_path / "notes.json").write_text('{"a": 1}')
    (tmp_path / "b.txt").write_text("plain")
    assert [s.kind for s in corpus.sources(tmp_path)] == ["text", "text"]
    assert read_corpus(tmp_path).text == 'plain\n{"a": 1}'


def test_json_arrays_csv_and_compressed_text(tmp_path):
    """A .json array (of objects or strings), a CSV with a header (its --text-column), gzip'd
    text: each read as what it holds, not as raw text."""
    (tmp_path / "a.json").write_text(json.dumps([{"text": d, "n": 1} for d in DOCS]))
    assert corpus.kind_of(tmp_path / "a.json") == "json"
    assert read_corpus(tmp_path / "a.json").text == joined(DOCS)
    (tmp_path / "s.json").write_text(" \n" + json.dumps(DOCS))
    assert read_corpus(tmp_path / "s.json").text == joined(DOCS)
    with open(tmp_path / "c.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body"])
        writer.writerows([i, d] for i, d in enumerate(DOCS))
    assert read_corpus(tmp_path / "c.csv", text_column="body").text == joined(DOCS)
    with pytest.raises(DataError, match="c.csv: no column 'text' .*: pass --text-column"):
        read_corpus(tmp_path / "c.csv")
    with gzip.open(tmp_path / "t.txt.gz", "wt", encoding="utf-8") as f:
        f.write(DOCS[1])
    assert read_corpus(tmp_path / "t.txt.gz").text == DOCS[1]
    # A --text-column meeting text files only is said to be unused.
    notes = []
    load_split(tmp_path / "t.txt.gz", ByteTokenizer(), 4, 0.1, warn=notes.append, text_column="x")
    assert notes == ["note: --text-column x is unused: the corpus is text files, each read whole"]


def test_files_beside_records_are_named_and_null_texts_skipped_on_request(tmp_path):
    """A folder of Parquet, JSON Lines, a JSON array and CSV beside text files: the records are
    read, the text files named in a note; a null text is refused, or with skip_empty skipped
    and counted."""
    write_parquet(tmp_path / "a.parquet", DOCS[:2])
    write_jsonl(tmp_path / "b.jsonl", [{"text": DOCS[2]}, {"text": None}])
    (tmp_path / "c.json").write_text(json.dumps([DOCS[3]]))
    (tmp_path / "d.csv").write_text(f"text\n{DOCS[4]}\n")
    (tmp_path / "e.txt").write_text("not a record")
    with gzip.open(tmp_path / "f.txt.gz", "wt") as f:
        f.write("nor this")
    kinds = [s.kind for s in corpus.sources(tmp_path)]
    assert kinds == ["parquet", "jsonl", "json", "csv"]
    with pytest.raises(DataError, match="b.jsonl, record 2: 'text' is null.*--skip-empty"):
        load_split(tmp_path, ByteTokenizer(), 4, 0.1)
    notes = []
    split = load_split(tmp_path, ByteTokenizer(), 4, 0.1, warn=notes.append, skip_empty=True)
    expected = joined([DOCS[0], DOCS[1], DOCS[3], DOCS[4]])  # DOCS[2] is empty: skipped too
    assert len(split.train) + len(split.val) == len(expected.encode())
    assert notes == [
        f"note: 2 files beside the corpus's records are left out (not Parquet, Arrow, JSON "
        f"Lines, JSON array or CSV files): {tmp_path / 'e.txt'}, {tmp_path / 'f.txt.gz'}",
        "note: 2 records with null or empty text skipped",
    ]


@pytest.mark.parametrize("layout", ["stream", "file"])
def test_arrow_files(tmp_path, layout):
    """Arrow IPC files (the stream format is what `datasets` writes its shards in), in a folder
    beside other files; a missing column and a truncated file are one line each."""
    table = pa.table({"text": DOCS, "n": list(range(len(DOCS)))})
    path = tmp_path / "shards" / "data-00000-of-00001.arrow"
    path.parent.mkdir()
    new = pa.ipc.new_stream if layout == "stream" else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    (tmp_path / "shards" / "README.md").write_text("# card")
    assert read_corpus(tmp_path / "shards").text == joined(DOCS)
    with pytest.raises(DataError, match="no column 'body'"):
        read_corpus(path, text_column="body")
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(DataError) as error:
        read_corpus(cut)
    assert str(cut) in str(error.value) and "truncated or damaged" in str(error.value)


def test_datasets_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    dataset.save_to_disk(str(tmp_path / "single"))
    assert read_corpus(tmp_path / "single").text == joined(DOCS)
    splits = datasets.DatasetDict(train=dataset, validation=dataset.select([0]))
    splits.save_to_disk(str(tmp_path / "dict"))
    assert read_corpus(tmp_path / "dict").text == joined(DOCS)
    datasets.DatasetDict(test=dataset).save_to_disk(str(tmp_path / "test_only"))
    with pytest.raises(DataError, match="no 'train' split .it has test."):
        read_corpus(tmp_path / "test_only")
    with pytest.raises(DataError, match="no column 'body'"):
        read_corpus(tmp_path / "single", text_column="body")


def test_each_record_is_a_document_when_packing(tmp_path):
    """--pack-documents: a record's tokens begin where its text does; the plain split is the
    same tokens."""
    path = write_parquet(tmp_path / "c.parquet", DOCS * 4)
    packed = load_split(path, ByteTokenizer(), 8, 0.1, pack_documents=True)
    plain = load_split(path, ByteTokenizer(), 8, 0.1)
    assert torch.equal(packed.train, plain.train) and torch.equal(packed.val, plain.val)
    docs = DOCS * 4
    byte_starts = [sum(len(d.encode()) + 1 for d in docs[:i]) for i in range(len(docs))]
    expected = [s for s in byte_starts if s < len(packed.train)]  # an empty record: its newline
    assert packed.train_starts.tolist() == expected


def bad_inputs(tmp_path):
    """(path, text of the expected one-line error) for each kind of bad input."""
    cases = {}
    cases["missing column"] = (
        write_parquet(tmp_path / "nocol.parquet", DOCS, column="body"),
        "nocol.parquet: no column 'text'",
    )
    cases["parquet number"] = (
        write_parquet(tmp_path / "num.parquet", DOCS, column="other", text=list(range(5))),
        "num.parquet, record 1: 'text' is a int, not text",
    )
    cases["parquet null"] = (
        write_parquet(tmp_path / "null.parquet", ["a", "b", None, "d"]),
        "null.parquet, record 3: 'text' is null, not text",
    )
    good = write_parquet(tmp_path / "good.parquet", DOCS * 50)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["truncated parquet"] = (cut, "cut.parquet: not a readable Parquet file, truncated")
    cases["json number"] = (
        write_jsonl(tmp_path / "num.jsonl", [{"text": "a"}, {"text": 7}]),
        "num.jsonl, record 2: 'text' is a int, not text",
    )
    cases["json field"] = (
        write_jsonl(tmp_path / "field.jsonl", [{"text": "a"}, {"body": "b"}]),
        "field.jsonl, record 2: no field 'text'",
    )
    cases["json list"] = (
        write_jsonl(tmp_path / "list.jsonl", [["a"]]),
        "list.jsonl, record 1: a JSON list, not an object",
    )
    cut_line = tmp_path / "cutline.jsonl"
    cut_line.write_text('{"text": "a"}\n{"text": "b')
    cases["truncated jsonl"] = (  # the parser's message whole, with its position
        cut_line,
        "cutline.jsonl, record 2: not valid JSON (Unterminated string starting at: line 1 "
        "column 10",
    )
    gz = write_jsonl(tmp_path / "g.jsonl.gz", [{"text": d} for d in DOCS * 200], gzip.open)
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    cases["truncated gzip"] = (cut_gz, "cut.jsonl.gz, after record")
    empty = tmp_path / "empty"
    empty.mkdir()
    write_parquet(empty / "a.parquet", ["", " "])
    write_jsonl(empty / "b.jsonl", [{"text": "\n"}])
    cases["empty corpus"] = (empty, f"the corpus at {empty} is empty")
    return cases


CASES = [
    "missing column",
    "parquet number",
    "parquet null",
    "truncated parquet",
    "json number",
    "json field",
    "json list",
    "truncated jsonl",
    "truncated gzip",
    "empty corpus",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_file_and_record(tmp_path, case):
    path, expected = bad_inputs(tmp_path)[case]
    with pytest.raises(DataError) as error:
        load_split(path, ByteTokenizer(), 8, 0.1)
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def test_training_command_on_parquet_shards(tmp_path, capsys):
    """fastlm-train --data on a folder of Parquet shards, documents packed; a bad shard is one
    line on stderr, exit status 2."""
    from test_train import TOY, run_main

    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        write_parquet(shards / f"{i:03d}.parquet", DOCS * 6)
    args = ["--data", shards, *TOY, "--steps", "4", "--pack-documents"]
    status, summary, err = run_main([*args, "--out", tmp_path / "run"], capsys)
    assert status == 0, err
    assert 0 < summary["targets_ignored"] < summary["targets"]
    write_parquet(shards / "003.parquet", DOCS, column="body")
    status, _, err = run_main([*args, "--out", tmp_path / "bad"], capsys)
    assert status == 2 and err.strip().count("\n") == 0
    assert f"fastlm-train: error: {shards / '003.parquet'}: no column 'text'" in err


def test_training_corpus_is_tokenized_as_it_is_read(tmp_path, monkeypatch):
    """Without a cache, each document is tokenized as its record batch comes in: never the whole
    text at once (the old way held it all, then its tokens); the tokens are the joined text's,
    under a progress bar that says what is tokenized and counts the file's bytes."""
    import fastlm.data

    docs = DOCS * 3
    path = write_parquet(tmp_path / "one.parquet", docs)
    monkeypatch.setattr(corpus, "ROWS_PER_BATCH", 2)
    events = []
    iter_batches = pq.ParquetFile.iter_batches

    def batches(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            events.append(("batch", batch.num_rows))
            yield batch

    class Spy(ByteTokenizer):
        def encode(self, text):
            events.append(("encode", len(text)))
            return super().encode(text)

    bars, tqdm = [], fastlm.data.tqdm

    def bar(**kwargs):
        bars.append(kwargs)
        return tqdm(**kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", batches)
    monkeypatch.setattr(fastlm.data, "tqdm", bar)
    split = load_split(path, Spy(), context_length=8, val_fraction=0.2, progress=True)
    (kwargs,) = bars
    assert f"tokenizing the corpus at {path} (1 file)" in kwargs["desc"]
    assert kwargs["total"] == path.stat().st_size
    kinds = [kind for kind, _ in events]
    assert kinds.count("batch") == (len(docs) + 1) // 2
    assert kinds.index("encode") < len(kinds) - 1 - kinds[::-1].index("batch")
    assert max(n for kind, n in events if kind == "encode") <= max(map(len, docs)) + 1
    tokens = torch.cat([split.train, split.val])
    assert bytes(tokens.tolist()) == "\n".join(docs).encode()
