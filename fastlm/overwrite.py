"""The one rule every command's `--overwrite` keeps: it never deletes what the same command reads.

A command that replaces its output folder whole (`fastlm-prepare --out`, `fastlm-export --to-hf`,
`fastlm-train --out`) first checks the folder against each of its inputs, both resolved
(links followed): it must not be an input, hold one, or lie inside one. A checkpoint exported onto
itself, a corpus prepared onto its own folder, a tokenizer file inside the folder to replace: each
is refused in one line before anything is read or written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def check_spares_inputs(
    out: str | os.PathLike,
    out_flag: str,
    inputs: Iterable[tuple[str, str | os.PathLike]],
    error: type[ValueError],
) -> None:
    """`error` (the command's error class) when the folder `out` (named `out_flag` on the
    command line) is, holds or lies inside one of `inputs`, (flag, path) pairs of what the
    command reads."""
    target = Path(os.path.realpath(out))
    for flag, path in inputs:
        source = Path(os.path.realpath(path))
        if source == target:
            relation = "is"
        elif target in source.parents:
            relation = "holds"
        elif source in target.parents:
            relation = "lies inside"
        else:
            continue
        raise error(
            f"{out_flag} {out} {relation} {flag} {path}, which this command reads: --overwrite "
            f"never deletes an input, choose another {out_flag}"
        )
