"""`fastlm-generate`: continue a prompt with a model trained by `fastlm-train`.

    python -m fastlm.cli.generate --checkpoint checkpoints/tiny --prompt "def main(" --top-k 50

The text streams to stdout as it is sampled (the prompt first); a multibyte character whose bytes
arrive over several steps is printed once whole. Sampling is `fastlm.sample`'s: temperature
(0 is greedy), top-k, top-p, a KV cache when the model has one; only token ids the tokenizer can
decode are drawn. Runs on CPU by default. `--seed` takes any integer (torch's generator takes it
modulo 2**64). A prompt byte that is not UTF-8 (a shell passes it on as is) is a byte token like
any other with the byte tokenizer, shown as U+FFFD as a sampled one would be; a tokenizer.json
tokenizer takes text only and refuses it.
Exit status: 0, or 2 with one line on stderr for a bad checkpoint or argument.

`--checkpoint` also takes a Hugging Face model folder (config.json, weights, tokenizer.json) of a
Llama, Mistral or Qwen2 model that `fastlm.hf.from_hf` converts, such as fastlm-export writes.

This module is the command; `fastlm.sample` is the function to call from Python.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from fastlm import checkpoint, sampling
from fastlm.checkpoint import CheckpointError
from fastlm.config import (
    MODELS,
    ConfigError,
    ModelConfig,
    build_model,
    check_integers,
    pick_device,
    torch_seed,
)
from fastlm.data import DataError
from fastlm.tokens import ByteTokenizer, load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastlm-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="folder written by fastlm-train, or a Hugging Face Llama/Mistral/Qwen2 folder",
    )
    parser.add_argument("--prompt", required=True, help="text to continue (not empty)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="default: %(default)s")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="default: %(default)s; 0 is greedy"
    )
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens")
    parser.add_argument(
        "--top-p",
        type=float,
        help="sample among the likeliest tokens whose probabilities add up to p",
    )
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="fastlm",
        help="default: %(default)s; both load the same checkpoints",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> torch.device:
    """ConfigError for a bad argument, before anything is loaded; the device to run on."""
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be non-negative, got {args.max_new_tokens}")
    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    try:
        sampling.check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_integers(vars(args), exempt=("seed", "top_k"))  # a top-k past the vocabulary is all
    return pick_device(args.device)


#: A Hugging Face model folder's config file (a fastlm checkpoint has none).
HF_CONFIG = "config.json"
#: config.json's record of the tokenizer a model was trained with ("bytes", or "hf-<digest>"),
#: written by fastlm-export.
TOKENIZER_FIELD = "fastlm_tokenizer"


def load_model(folder, model_name: str, device: torch.device | str):
    """The checkpoint's model (weights checked against its stored configuration and checksum)
    and tokenizer; or those of a Hugging Face model folder (`load_hf_model`)."""
    if (Path(folder) / HF_CONFIG).is_file():
        return load_hf_model(Path(folder), model_name, device)
    folder = checkpoint.resolve(folder)
    stored = checkpoint.load_config(folder)
    try:
        config = ModelConfig.from_dict(stored)
        config.check(model_name, device)
    except KeyError as error:
        raise CheckpointError(f"{folder}: {error.args[0]}") from None
    except ValueError as error:
        raise CheckpointError(
            f"{folder}: the stored configuration cannot run here: {error}"
        ) from None
    tokenizer_name = stored.get("tokenizer")
    if not isinstance(tokenizer_name, str):
        raise CheckpointError(f"{folder}: the stored configuration names no tokenizer")
    tokenizer_path = folder / checkpoint.TOKENIZER if tokenizer_name != "bytes" else None
    if tokenizer_path is not None and not tokenizer_path.is_file():
        raise CheckpointError(
            f"{folder} was trained with a tokenizer file but holds no {checkpoint.TOKENIZER}"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.name != tokenizer_name:  # a Hugging Face tokenizer's name is its file's digest
        raise CheckpointError(f"{tokenizer_path} is not the tokenizer the model was trained with")
    model = build_model(config, model_name, device)
    checkpoint.fit_weights(model, checkpoint.load_weights(folder), folder)
    return model.eval(), tokenizer


def load_hf_model(folder: Path, model_name: str, device: torch.device | str):
    """A Llama, Mistral or Qwen2 model folder (`fastlm.hf.from_hf` converts it, in float32) and
    its tokenizer.json, or the byte tokenizer for a folder fastlm-export wrote from a byte-level
    model."""
    from fastlm.hf import from_hf
    from fastlm.hf.families import transformers_module

    try:
        transformers = transformers_module()
    except ModuleNotFoundError as error:
        raise CheckpointError(f"{folder} is a Hugging Face model folder: {error}") from None
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{folder}: cannot load the Hugging Face model ({error})") from None
    try:
        model = from_hf(hf_model, model=model_name)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder}: {error}") from None
    if (folder / checkpoint.TOKENIZER).is_file():
        tokenizer = load_tokenizer(folder / checkpoint.TOKENIZER)
    elif getattr(hf_model.config, TOKENIZER_FIELD, None) == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise CheckpointError(
            f"{folder} holds no {checkpoint.TOKENIZER} (fastlm-generate reads a fast "
            "tokenizer's file)"
        )
    return model.to(device).eval(), tokenizer


def stream(args: argparse.Namespace) -> int:
    device = check_args(args)
    model, tokenizer = load_model(args.checkpoint, args.model, device)
    try:
        prompt_ids = tokenizer.encode(args.prompt).long().to(device)
    except DataError as error:
        raise ConfigError(f"--prompt: {error}") from None
    if prompt_ids.numel() == 0:
        raise ConfigError("--prompt encodes to no tokens")
    if int(prompt_ids.max()) >= model.vocab_size:
        raise CheckpointError("the prompt has token ids outside the checkpoint's vocabulary")
    generator = torch.Generator(device).manual_seed(torch_seed(args.seed))
    decoder = tokenizer.stream_decoder()
    if isinstance(tokenizer, ByteTokenizer):
        # The prompt's bytes go through the decoder the continuation goes through: a byte that
        # is not UTF-8 shows as U+FFFD, as a sampled one would, and a character the prompt
        # leaves unfinished is printed once the continuation finishes it.
        echo = "".join(decoder.push(token) for token in prompt_ids.tolist())
    else:
        echo = args.prompt
    sys.stdout.write(echo)
    sys.stdout.flush()
    started, count = time.perf_counter(), 0
    # A model may have a larger vocabulary than its tokenizer (--vocab-size): never draw an id
    # the tokenizer cannot decode.
    for next_ids in sampling.sample_stream(
        model,
        prompt_ids,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        generator,
        vocab_size=tokenizer.vocab_size,
    ):
        sys.stdout.write(decoder.push(int(next_ids[0])))
        sys.stdout.flush()
        count += 1
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    seconds = time.perf_counter() - started
    print(f"fastlm-generate: {count} tokens in {seconds:.2f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, stream the continuation, and return the exit status."""
    args = parse_args(argv)
    try:
        return stream(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm-generate: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
