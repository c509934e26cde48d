"""`python -m fastlm.generate`: continue a prompt with a model trained by `python -m fastlm.train`.

    python -m fastlm.generate --checkpoint checkpoints/tiny --prompt "def main(" --top-k 50

The text streams to stdout as it is sampled (the prompt first); a multibyte character whose bytes
arrive over several steps is printed once whole. Sampling is `fastlm.generate`'s: temperature
(0 is greedy), top-k, top-p, a KV cache when the model has one. Runs on CPU by default.
Exit status: 0, or 2 with one line on stderr for a bad checkpoint or argument.
"""

from __future__ import annotations

import argparse
import sys
import time
import types

import torch

from fastlm import checkpoint, sampling
from fastlm.checkpoint import CheckpointError
from fastlm.data import DataError, load_tokenizer
from fastlm.train import MODEL_FIELDS, ConfigError, build_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fastlm.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="folder written by fastlm.train")
    parser.add_argument("--prompt", required=True, help="text to continue (not empty)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="default: %(default)s; 0 is greedy")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=float, help="sample among the likeliest tokens whose "
                        "probabilities add up to p")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--model", choices=("fastlm", "reference"), default="fastlm",
                        help="default: %(default)s; both load the same checkpoints")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be non-negative, got {args.max_new_tokens}")
    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    # The sampler checks temperature, top-k and top-p itself; one draw from dummy logits (with
    # a generator of its own) runs those checks before anything streams, so a bad value is a
    # one-line error and no text.
    try:
        sampling.sample_next(torch.zeros(1, 2), args.temperature, args.top_k, args.top_p,
                             torch.Generator().manual_seed(0))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def load_model(folder, model_name: str, device: str) -> tuple[torch.nn.Module, object]:
    """The checkpoint's model (weights checked against its stored configuration) and tokenizer."""
    folder = checkpoint.resolve(folder)
    config = checkpoint.load_config(folder)
    missing = [key for key in (*MODEL_FIELDS, "tokenizer") if key not in config]
    if missing:
        raise CheckpointError(f"{folder}: the stored configuration lacks {', '.join(missing)}")
    tokenizer_path = folder / checkpoint.TOKENIZER if config["tokenizer"] != "bytes" else None
    if tokenizer_path is not None and not tokenizer_path.is_file():
        raise CheckpointError(f"{folder} was trained with a tokenizer file but holds no "
                              f"{checkpoint.TOKENIZER}")
    tokenizer = load_tokenizer(tokenizer_path)
    model = build_model(model_name, config, device)
    try:
        model.load_state_dict(checkpoint.load_weights(folder))
    except RuntimeError as error:  # missing keys or other shapes than the configuration's
        first_line = str(error).strip().splitlines()[0]
        raise CheckpointError(f"{folder}: the weights do not fit the stored configuration "
                              f"({first_line})") from None
    return model.eval(), tokenizer


def stream(args: argparse.Namespace) -> int:
    check_args(args)
    model, tokenizer = load_model(args.checkpoint, args.model, args.device)
    prompt_ids = tokenizer.encode(args.prompt).long().to(args.device)
    if prompt_ids.numel() == 0:
        raise ConfigError("--prompt encodes to no tokens")
    if int(prompt_ids.max()) >= model.vocab_size:
        raise CheckpointError("the prompt has token ids outside the checkpoint's vocabulary")
    generator = torch.Generator(args.device).manual_seed(args.seed)
    decoder = tokenizer.stream_decoder()
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    started, count = time.perf_counter(), 0
    for next_ids in sampling.generate_stream(model, prompt_ids, args.max_new_tokens,
                                             args.temperature, args.top_k, args.top_p, generator):
        sys.stdout.write(decoder.push(int(next_ids[0])))
        sys.stdout.flush()
        count += 1
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    seconds = time.perf_counter() - started
    print(f"fastlm.generate: {count} tokens in {seconds:.2f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, stream the continuation, and return the exit status."""
    args = parse_args(argv)
    try:
        return stream(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm.generate: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


class _CallableModule(types.ModuleType):
    """Importing this module makes `fastlm.generate` (the package attribute) this module, hiding
    the sampling function of the same name; calling the module samples, so that
    `fastlm.generate(model, prompt_ids, ...)` keeps working after `import fastlm.generate`."""

    def __call__(self, *args, **kwargs):
        return sampling.generate(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
