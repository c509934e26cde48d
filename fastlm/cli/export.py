"""`fastlm-export`: a checkpoint of `fastlm-train` as a Hugging Face model folder.

    fastlm-export --checkpoint checkpoints/tiny --to-hf hf/tiny
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf/tiny')"

The folder holds config.json, model.safetensors and generation_config.json (sampling as
fastlm-generate's defaults: temperature 0.8), and the tokenizer's files (tokenizer.json,
tokenizer_config.json) when the run had a tokenizer.json. The weights go through
`fastlm.hf.to_hf`: fastlm's model with the LLaMA-style options is a Llama (grouped-query
attention, tied embeddings, RMSNorm's epsilon, RoPE's theta carry over). RoPE on interleaved pairs
(fastlm-train's default) has no transformers family, but it is the half-split RoPE transformers
uses on q and k rows permuted within each head, and q . k is unchanged by the same permutation of
both: the export permutes them, exactly, and the logits are the same. A byte-tokenizer model has no
tokenizer files (its token ids are UTF-8 bytes); config.json records `fastlm_tokenizer: bytes`,
which fastlm-generate reads back. The folder is written beside OUT and renamed into place whole.
Exit status: 0, or 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError
from fastlm.cli.generate import TOKENIZER_FIELD, load_model
from fastlm.config import ConfigError
from fastlm.data import DataError
from fastlm.hf.families import CONVERTIBLE
from fastlm.overwrite import check_spares_inputs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastlm-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="folder written by fastlm-train")
    parser.add_argument("--to-hf", required=True, metavar="OUT", help="the folder to write")
    parser.add_argument(
        "--family",
        choices=CONVERTIBLE,
        default="llama",
        help="the transformers family to write (default: %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT")
    return parser.parse_args(argv)


def export(folder: str | Path, out: str | Path, family: str = "llama", overwrite: bool = False):
    """Write the checkpoint `folder` as a Hugging Face model folder `out`; its path."""
    from fastlm.hf import to_hf
    from fastlm.hf.families import transformers_module

    try:
        transformers = transformers_module()
    except ModuleNotFoundError as error:
        raise ConfigError(str(error)) from None
    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists: pass --overwrite to replace it, or another OUT")
    source = checkpoint.resolve(folder)
    if overwrite and out.exists():
        inputs = [("--checkpoint", folder), ("--checkpoint", source)]  # source: maybe FOLDER.old
        check_spares_inputs(out, "--to-hf", inputs, ConfigError)
    model, tokenizer = load_model(source, "reference", "cpu")  # PyTorch ops: any host
    hf_model = to_hf(model, family)
    setattr(hf_model.config, TOKENIZER_FIELD, tokenizer.name)
    hf_model.generation_config = transformers.GenerationConfig(
        do_sample=True, temperature=0.8, max_length=model.context_length
    )
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        hf_model.save_pretrained(staging)
        if (source / checkpoint.TOKENIZER).is_file():
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_file=str(source / checkpoint.TOKENIZER)
            )
            fast.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write {out} ({error.strerror or error})") from None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = export(args.checkpoint, args.to_hf, args.family, args.overwrite)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm-export: error: {error}", file=sys.stderr)
        return 2
    print(f"fastlm-export: wrote {out} ({args.family})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
