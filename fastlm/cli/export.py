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

A mixture-of-experts model is written as the transformers family that computes its layers
exactly (`moe_to_hf`): a softmax router as Qwen2-MoE (`qwen2_moe`: norm_topk_prob, dense-first
layers as mlp_only_layers, shared experts as its shared expert, whose sigmoid gate gets a zero
weight, sigmoid(0) = 1/2, and whose down projection is doubled: exact, both factors powers of
two), a sigmoid router as GLM-4.5 (`glm4_moe`: e_score_correction_bias, one group,
routed_scaling_factor 1, first_k_dense_replace, n_shared_experts, full-width RoPE, no q/k norm).
Qwen3-MoE is refused: its attention normalises q and k per head (q_norm, k_norm), which
fastlm's does not. --family defaults to the router's family (llama for a dense model).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

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
        choices=(*CONVERTIBLE, *MOE_FAMILIES.values(), "qwen3_moe"),
        help="the transformers family to write (default: llama; for a mixture of experts "
        "qwen2_moe with a softmax router, glm4_moe with a sigmoid one)",
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


#: The transformers family that computes a mixture-of-experts model's layers exactly, by router.
MOE_FAMILIES = {"softmax": "qwen2_moe", "sigmoid": "glm4_moe"}


def _moe_problems(model, family: str | None) -> str | None:
    """Why `family` cannot hold `model` exactly (a mixture of experts or not), or None."""
    layers = model.moe_layers()
    if not layers:
        if family in (*MOE_FAMILIES.values(), "qwen3_moe"):
            return f"--family {family} is a mixture-of-experts family; this model is dense"
        return None
    router = layers[0].router
    wanted = MOE_FAMILIES[router.kind]
    if family == "qwen3_moe":
        return (
            "Qwen3-MoE's attention normalises q and k per head (q_norm, k_norm), which "
            f"fastlm's does not: --family {wanted} computes this model exactly"
        )
    if family != wanted:
        return (
            f"a mixture of experts with a {router.kind} router is written as --family {wanted} "
            f"(the family whose router computes it exactly), not {family}"
        )
    if router.kind == "sigmoid" and router.num_experts < 2:
        return "glm4_moe's group-limited routing needs at least 2 experts"
    return None


def moe_to_hf(model, family: str, transformers):
    """A transformers ForCausalLM of `family` (`MOE_FAMILIES`) holding the weights of a
    mixture-of-experts `fastlm.reference.Transformer` (or `fastlm.Transformer`), on its
    device and in its dtype, computing the same logits (the module docstring says how each
    option maps). RuntimeError when transformers' parameter names differ."""
    from fastlm.hf.convert import attention_state

    moe = model.moe_layers()[0]
    router, experts = moe.router, moe.experts
    attention = model.blocks[0].mult_head_atten
    rope = attention.rope
    embedding = model.embedding.w
    d_model = embedding.shape[1]
    first_dense = next(i for i, b in enumerate(model.blocks) if b.ffe is moe)
    shared = moe.shared.w1.w.shape[0] if moe.shared is not None else 0
    dense_d_ff = model.blocks[0].ffe.w1.w.shape[0] if first_dense else experts.d_ff
    fields = dict(
        vocab_size=model.vocab_size,
        hidden_size=d_model,
        intermediate_size=dense_d_ff,
        num_hidden_layers=len(model.blocks),
        num_attention_heads=attention.num_heads,
        num_key_value_heads=attention.num_kv_heads,
        max_position_embeddings=model.context_length,
        rms_norm_eps=model.final_norm.eps,
        tie_word_embeddings=model.out_linear.w is embedding,
        hidden_act="silu",
        moe_intermediate_size=experts.d_ff,
        num_experts_per_tok=router.experts_per_token,
        norm_topk_prob=router.normalize_top_k,
        attention_bias=False,
    )
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope.theta)}
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **fields,
            rope_parameters=rope_parameters,
            num_experts=router.num_experts,
            shared_expert_intermediate_size=shared,
            mlp_only_layers=list(range(first_dense)),
            decoder_sparse_step=1,
            qkv_bias=False,
            use_sliding_window=False,
            router_aux_loss_coef=model.aux_loss_coef,
        )
        hf_model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.Glm4MoeConfig(
            **fields,
            rope_parameters={**rope_parameters, "partial_rotary_factor": 1.0},
            partial_rotary_factor=1.0,
            n_routed_experts=router.num_experts,
            n_shared_experts=shared // experts.d_ff,
            first_k_dense_replace=first_dense,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            use_qk_norm=False,
        )
        hf_model = transformers.Glm4MoeForCausalLM(config)
    hf_model.to(device=embedding.device, dtype=embedding.dtype)
    state = attention_state(model)

    def mlp(prefix: str, ffn, down_scale: float = 1.0) -> None:
        state[prefix + "gate_proj.weight"] = ffn.w1.w
        state[prefix + "up_proj.weight"] = ffn.w3.w
        state[prefix + "down_proj.weight"] = ffn.w2.w * down_scale

    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}."
        layer = block.ffe
        if i < first_dense:
            mlp(prefix + "mlp.", layer)
            continue
        state[prefix + "mlp.gate.weight"] = layer.router.weight
        state[prefix + "mlp.experts.gate_up_proj"] = layer.experts.gate_up
        state[prefix + "mlp.experts.down_proj"] = layer.experts.down
        if family == "glm4_moe":
            state[prefix + "mlp.gate.e_score_correction_bias"] = layer.router.selection_bias
            if layer.shared is not None:
                mlp(prefix + "mlp.shared_experts.", layer.shared)
        elif layer.shared is not None:  # sigmoid(0 . x) = 1/2 of twice the output: exact
            mlp(prefix + "mlp.shared_expert.", layer.shared, down_scale=2.0)
            state[prefix + "mlp.shared_expert_gate.weight"] = layer.router.weight.new_zeros(
                1, d_model
            )
    with torch.no_grad():
        missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if fields["tie_word_embeddings"]:
        missing = [name for name in missing if name != "lm_head.weight"]
    if not shared:  # zero-width shared experts: nothing to fill
        missing = [name for name in missing if "shared_expert" not in name]
    if missing or unexpected:
        raise RuntimeError(f"moe_to_hf: parameters not filled {missing}, unexpected {unexpected}")
    return hf_model


def export(
    folder: str | Path,
    out: str | Path,
    family: str | None = None,
    overwrite: bool = False,
    eos_token: str | None = None,
    bos_token: str | None = None,
):
    """Write the checkpoint `folder` as a Hugging Face model folder `out`; its path. family:
    None (the default) for llama, or for a mixture of experts its router's family
    (`MOE_FAMILIES`). eos_token, bos_token: the tokenizer's end- and beginning-of-text tokens
    (default: the first of `fastlm.tokens.END_OF_TEXT` / `BEGIN_OF_TEXT` it has; none for the
    byte tokenizer)."""
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
    layers = model.moe_layers()
    if family is None:
        family = MOE_FAMILIES[layers[0].router.kind] if layers else "llama"
    problem = _moe_problems(model, family)
    if problem:
        raise ConfigError(problem)
    eos = special_token(tokenizer, END_OF_TEXT, eos_token)
    bos = special_token(tokenizer, BEGIN_OF_TEXT, bos_token)
    ids = {"bos_token_id": bos and bos[1], "eos_token_id": eos and eos[1]}
    hf_model = moe_to_hf(model, family, transformers) if layers else to_hf(model, family)
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
    print(f"fastlm-export: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
