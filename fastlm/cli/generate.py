"""`fastlm-generate`: continue a prompt with a model trained by `fastlm-train`.

    python -m fastlm.cli.generate --checkpoint checkpoints/tiny --prompt "def main(" --top-k 50

The text streams to stdout as it is sampled (the prompt first); a multibyte character whose bytes
arrive over several steps is printed once whole. Sampling is `fastlm.sample`'s: temperature
(0 is greedy), top-k, top-p, a KV cache when the model has one; only token ids the tokenizer can
decode are drawn. Runs on CPU by default. `--seed` takes any integer (torch's generator takes it
modulo 2**64). A prompt byte that is not UTF-8 (a shell passes it on as is) is a byte token like
any other with the byte tokenizer, shown as U+FFFD as a sampled one would be; a tokenizer.json
tokenizer takes text only and refuses it.
By default it draws what the model's context leaves after the prompt (200 tokens at most), so
that the model always sees the whole text; `--max-new-tokens` goes past it. Past the context the
fastlm model's KV cache slides: each new token attends to itself and the context-length - 1
tokens before it, whose keys and values are those computed when each was new (a sliding-window
attention at the context's relative distances), and each step costs one token's forward. That is
not re-encoding the last context-length tokens from position 0, which `--model reference` does
at every step (context-length tokens' forward each). `--stop-at-eos` stops at the tokenizer's
end-of-text token (`<|endoftext|>`, `</s>`, ... : `fastlm.tokens.END_OF_TEXT`), which is not
printed; a tokenizer without one (the byte tokenizer) refuses it.
Exit status: 0, or 2 with one line on stderr for a bad checkpoint or argument.

`--checkpoint` also takes a Hugging Face model folder (config.json, weights, tokenizer.json) of a
Llama, Mistral or Qwen2 model that `fastlm.hf.from_hf` converts, such as fastlm-export writes.

This module is the command; from Python, `fastlm.checkpoint.load_model(folder)` gives the
checkpoint's (model, tokenizer) and `fastlm.sample` samples.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fastlm import sampling
from fastlm.checkpoint import CheckpointError, load_model
from fastlm.cli import cpu_threads
from fastlm.config import MODELS, ConfigError, check_integers, pick_device, torch_seed
from fastlm.data import DataError
from fastlm.tokens import END_OF_TEXT, ByteTokenizer, special_token

#: --max-new-tokens when the context leaves room for as many.
DEFAULT_NEW_TOKENS = 200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastlm-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="folder written by fastlm-train, or a Hugging Face Llama/Mistral/Qwen2 folder",
    )
    parser.add_argument("--prompt", required=True, help="text to continue (not empty)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"default: what the model's context leaves after the prompt, {DEFAULT_NEW_TOKENS} at "
        "most. Past the context the fastlm model's KV cache slides (each token attends to the "
        "context-length - 1 before it, their keys and values kept as computed when each was "
        "new: one token's forward a step); --model reference re-encodes the last context-length "
        "tokens at every step",
    )
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at the tokenizer's end-of-text token (the first it has of "
        + ", ".join(END_OF_TEXT)
        + "), which is not printed",
    )
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
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: OMP_NUM_THREADS if set, else the cores the machine's load "
        "leaves free, at least 1, and no more than the model's step pays for: 1, and 1 more for "
        "each 2 GFLOP of a step: one token's forward)",
    )
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> torch.device:
    """ConfigError for a bad argument, before anything is loaded; the device to run on."""
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be non-negative, got {args.max_new_tokens}")
    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")
    try:
        sampling.check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_integers(vars(args), exempt=("seed", "top_k"))  # a top-k past the vocabulary is all
    return pick_device(args.device)


def stream(args: argparse.Namespace) -> int:
    device = check_args(args)
    model, tokenizer = load_model(args.checkpoint, args.model, device)
    on = ""
    if device.type == "cpu":  # a step: one token's forward, 2 FLOPs a weight
        work = 2 * sum(p.numel() for p in model.parameters())
        threads, why = cpu_threads(args.threads, work)
        torch.set_num_threads(threads)  # main() restores the setting
        on = f" on {threads} CPU thread{'s' if threads > 1 else ''} ({why})"
    try:
        prompt_ids = tokenizer.encode(args.prompt).long().to(device)
    except DataError as error:
        raise ConfigError(f"--prompt: {error}") from None
    if prompt_ids.numel() == 0:
        raise ConfigError("--prompt encodes to no tokens")
    if int(prompt_ids.max()) >= model.vocab_size:
        raise CheckpointError("the prompt has token ids outside the checkpoint's vocabulary")
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        # Within the context: past it the model attends to a sliding window only.
        room = model.context_length - prompt_ids.numel()
        if room <= 0:
            raise ConfigError(
                f"the prompt's {prompt_ids.numel()} tokens fill the model's context of "
                f"{model.context_length}: pass --max-new-tokens to go on (the model then attends "
                f"to the last {model.context_length} tokens)"
            )
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
    end = special_token(tokenizer, END_OF_TEXT) if args.stop_at_eos else None
    if args.stop_at_eos and end is None:
        raise ConfigError(
            "--stop-at-eos: the tokenizer has no end-of-text token (none of "
            + ", ".join(END_OF_TEXT)
            + ")"
        )
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
    started, count, stopped = time.perf_counter(), 0, ""
    # A model may have a larger vocabulary than its tokenizer (--vocab-size): never draw an id
    # the tokenizer cannot decode.
    for next_ids in sampling.sample_stream(
        model,
        prompt_ids,
        max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        generator,
        vocab_size=tokenizer.vocab_size,
    ):
        token = int(next_ids[0])
        if end is not None and token == end[1]:
            stopped = f", stopped at {end[0]}"
            break
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
        count += 1
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    seconds = time.perf_counter() - started
    print(f"fastlm-generate: {count} tokens in {seconds:.2f} s{on}{stopped}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, stream the continuation, and return the exit status."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return stream(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm-generate: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
