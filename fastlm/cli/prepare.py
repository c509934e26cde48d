"""`fastlm-prepare`: tokenize a corpus once into a folder `fastlm-train --data` memory-maps.

    fastlm-prepare --data fineweb-edu/sample/10BT --tokenizer tokenizer.json --out data/edu \\
        --workers 16 --document-end '<|endoftext|>'
    fastlm-train --data data/edu --tokenizer tokenizer.json --pack-documents ...

`--data` is what `fastlm-train --data` takes: text files, Parquet, JSON Lines or a `datasets`
folder (`fastlm.corpus`). The folder's layout, the held-out split and how an interrupted run
resumes are `fastlm.token_cache`'s. The progress bar goes to stderr, one JSON line (the
metadata, without the list of sources) to stdout.
Exit status: 0 done, 2 bad input or a full disk (one line on stderr; nothing written to --out),
130 interrupted (Ctrl-C) or 143 terminated (SIGTERM): the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from fastlm.corpus import DataError
from fastlm.token_cache import DOCUMENTS, PARTIAL, prepare


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fastlm-prepare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True, help="the corpus: as fastlm-train --data takes")
    parser.add_argument("--out", required=True, help="the folder to write (made whole at the end)")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizers JSON (default: UTF-8 bytes)")
    parser.add_argument(
        "--text-column", default="text", help="Parquet column or JSON field (%(default)s)"
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.05, help="held-out share, at the end (0.05)"
    )
    parser.add_argument(
        "--document-end",
        default="\n",
        metavar="TEXT",
        help="appended to each document before tokenizing (a newline; say '<|endoftext|>')",
    )
    parser.add_argument(
        "--document-separator",
        metavar="TEXT",
        help="a document also ends after each occurrence of TEXT (as fastlm-train's option)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizing processes (default: the CPUs, %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared --out")
    parser.add_argument(
        "--skip-empty",
        action="store_true",
        help="skip records whose text is null or empty (counted in a note) instead of "
        "refusing a null one",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt: no `except Exception` holds it)."""


def _terminate(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr)

    # SIGTERM (a job scheduler, `kill`) ends the run as Ctrl-C does: the pool's workers are
    # stopped and what is tokenized is kept, in one line, rather than the process vanishing
    # and leaving its workers to fail on the broken pipe.
    previous = signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    try:
        meta = prepare(
            args.data,
            args.out,
            args.tokenizer,
            text_column=args.text_column,
            val_fraction=args.val_fraction,
            document_end=args.document_end,
            document_separator=args.document_separator,
            workers=args.workers,
            overwrite=args.overwrite,
            skip_empty=args.skip_empty,
            progress=not args.no_progress,
            say=say,
        )
    except DataError as error:
        print(f"fastlm-prepare: error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        staging = Path(os.path.normpath(args.out) + PARTIAL)
        kept = (
            f"what is tokenized stays in {staging}; the same command resumes"
            if staging.is_dir()
            else "nothing was written"
        )
        how = "terminated" if isinstance(stop, Terminated) else "interrupted"
        say(f"fastlm-prepare: {how}: {kept}")
        return 128 + signal.SIGTERM if isinstance(stop, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - started
    summary = {k: v for k, v in meta.items() if k != "sources"}
    summary.update(sources=len(meta["sources"]), out=args.out, seconds=round(seconds, 2))
    say(
        f"fastlm-prepare: {meta['tokens']:,} tokens ({meta['dtype']}) of {meta['documents']:,} "
        f"document{'s' if meta['documents'] != 1 else ''} in {args.out} ({DOCUMENTS} included), "
        f"{seconds:.1f} s"
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
