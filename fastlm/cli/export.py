"""`fastlm-export`: a checkpoint of `fastlm-train` as a Hugging Face model folder.

    fastlm-export --checkpoint checkpoints/tiny --to-hf hf/tiny
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf/tiny')"

The folder holds config.json, model.safetensors and generation_config.json (sampling as
fastlm-generate's defaults: temperature 0.8), and the tokenizer's files (tokenizer.json,
tokenizer_config.json) when the run had a tokenizer.json. The tokenizer's end- and
beginning-of-text tokens (--eos-token, --bos-token, or the first it has of the usual names) are
written where transformers reads them: config.json's and generation_config.json's
eos_token_id/bos_token_id (so `generate` stops at the end of text), tokenizer_config.json's
eos_token/bos_token, whose model_max_length is the context length. A folder whose tokenizer
transformers' AutoTokenizer would load giving other ids (--family qwen2 picks Qwen2Tokenizer) is
refused. The weights go through
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
from fastlm.checkpoint import TOKENIZER_FIELD, CheckpointError, load_model
from fastlm.config import ConfigError
from fastlm.data import DataError
from fastlm.hf.families import CONVERTIBLE
from fastlm.overwrite import check_spares_inputs
from fastlm.tokens import BEGIN_OF_TEXT, END_OF_TEXT, PROBE, special_token


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
    parser.add_argument(
        "--eos-token",
        metavar="TEXT",
        help="the tokenizer's end-of-text token (default: the first it has of "
        + ", ".join(END_OF_TEXT)
        + ")",
    )
    parser.add_argument(
        "--bos-token",
        metavar="TEXT",
        help="its beginning-of-text token (default: the first it has of "
        + ", ".join(BEGIN_OF_TEXT)
        + ")",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT")
    return parser.parse_args(argv)


def export(
    folder: str | Path,
    out: str | Path,
    family: str = "llama",
    overwrite: bool = False,
    eos_token: str | None = None,
    bos_token: str | None = None,
):
    """Write the checkpoint `folder` as a Hugging Face model folder `out`; its path. eos_token,
    bos_token: the tokenizer's end- and beginning-of-text tokens (default: the first of
    `fastlm.tokens.END_OF_TEXT` / `BEGIN_OF_TEXT` it has; none for the byte tokenizer)."""
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
    eos = special_token(tokenizer, END_OF_TEXT, eos_token)
    bos = special_token(tokenizer, BEGIN_OF_TEXT, bos_token)
    ids = {"bos_token_id": bos and bos[1], "eos_token_id": eos and eos[1]}
    hf_model = to_hf(model, family)
    setattr(hf_model.config, TOKENIZER_FIELD, tokenizer.name)
    # The tokenizer's own ids, not the family's defaults (Llama's 1 and 2 are other tokens here).
    for key, value in ids.items():
        setattr(hf_model.config, key, value)
    # No max_length: transformers warns at each generate(max_new_tokens=...) of a folder that
    # sets one; config.json's max_position_embeddings is the context length.
    hf_model.generation_config = transformers.GenerationConfig(
        do_sample=True, temperature=0.8, **{k: v for k, v in ids.items() if v is not None}
    )
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        hf_model.save_pretrained(staging)
        if (source / checkpoint.TOKENIZER).is_file():
            special = {f"{name}_token": found[0] for name, found in (("eos", eos), ("bos", bos))
                       if found is not None}  # fmt: skip
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_file=str(source / checkpoint.TOKENIZER),
                model_max_length=model.context_length,
                **special,
            )
            fast.save_pretrained(staging)
            check_loads_alike(transformers, staging, tokenizer, family, eos)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write {out} ({error.strerror or error})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def check_loads_alike(transformers, folder: Path, tokenizer, family: str, eos) -> None:
    """ConfigError unless transformers' AutoTokenizer loads `folder` as a tokenizer that encodes
    text as the run's own: for some families (qwen2) it picks the family's tokenizer class,
    which rebuilds the tokenizer with the family's own pre-tokenizer and gives other ids."""
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    probe = PROBE + (eos[0] if eos else "")
    expected = tokenizer.encode(probe).tolist()
    got = loaded(probe, add_special_tokens=False)["input_ids"]
    if got != expected:
        raise ConfigError(
            f"transformers loads a {family} folder's tokenizer as {type(loaded).__name__}, "
            f"which encodes text otherwise than this tokenizer ({got[:6]}... against "
            f"{expected[:6]}...): export as --family llama, whose folder keeps the tokenizer"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = export(
            args.checkpoint, args.to_hf, args.family, args.overwrite, args.eos_token, args.bos_token
        )
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm-export: error: {error}", file=sys.stderr)
        return 2
    print(f"fastlm-export: wrote {out} ({args.family})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
