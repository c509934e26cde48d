"""Model configurations: the fields of a Transformer, the named presets, and building a model.

`ModelConfig` holds the constructor's fields of `fastlm.Transformer` and `reference.Transformer`
(the two take the same ones and read each other's checkpoints); `build_model` makes either from
it. `PRESETS` are the sizes `python -m fastlm.cli.train --preset` knows, each with the training
defaults that suit it. The commands (fastlm-train, fastlm-generate) share what else they check
here: `ConfigError` (one line on stderr, exit status 2), `pick_device`, `check_integers` and
`torch_seed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from fastlm import reference
from fastlm.model import Transformer, check_heads, kernels_run_on
from fastlm.options import ALIASES, INT64_MAX, check


class ConfigError(ValueError):
    """Bad command-line input (the commands print it as one line and exit with status 2)."""


MODELS = ("fastlm", "reference")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The constructor's fields of fastlm.Transformer and reference.Transformer.

    A frozen dataclass: `build_model(config)` builds either model of it, `config.as_dict()` is the
    constructor's keyword arguments (and what a checkpoint stores), `ModelConfig.from_dict` reads
    them back. Nothing is checked on construction: `check` says whether a model can run it.

    Args:
        vocab_size, context_length, d_model, num_layers, num_heads, d_ff: as in
            `fastlm.reference.Transformer`; required.
        rope_theta: RoPE's base (default 10000.0).
        num_kv_heads: key/value heads for grouped-query attention (default None: num_heads, no
            grouping).
        rope_interleaved: RoPE's pair layout (default True: interleaved).
        tie_embeddings: one parameter for the embedding and the output projection (default False).
        norm_eps: every RMSNorm's epsilon (default 1e-5).
        num_experts, experts_per_token, moe_d_ff, num_shared_experts, first_dense_layers, router,
            normalize_top_k, aux_loss_coef, z_loss_coef, router_bias_rate: the
            mixture-of-experts options of `fastlm.reference.Transformer` (default num_experts 0:
            the dense model).
    """

    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    # The LLaMA-style options (OPTION_DEFAULTS); a stored configuration without them has these.
    num_kv_heads: int | None = None  # None: num_heads (no grouping)
    rope_interleaved: bool = True
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    # The mixture-of-experts options (MOE_DEFAULTS; num_experts 0: the dense model).
    num_experts: int = 0
    experts_per_token: int = 2
    moe_d_ff: int | None = None  # None: d_ff
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    router: str = "softmax"
    normalize_top_k: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    router_bias_rate: float = 0.001

    @classmethod
    def from_dict(cls, values: Mapping) -> ModelConfig:
        """The configuration stored in `values` (a checkpoint's, say).

        Args:
            values: a mapping holding at least the required fields; fields that are not the
                model's (a checkpoint's configuration also names its tokenizer) are ignored,
                and the LLaMA-style options it lacks take their defaults (`OPTION_DEFAULTS`).

        Returns:
            A ModelConfig.

        Raises:
            KeyError: naming the missing fields that have no default.
        """
        missing = [name for name in REQUIRED_FIELDS if name not in values]
        if missing:
            raise KeyError(f"the configuration lacks {', '.join(missing)}")
        return cls(**{name: with_defaults(values)[name] for name in MODEL_FIELDS})

    def as_dict(self) -> dict:
        """The fields by name.

        Returns:
            A dict of every field, the keyword arguments of either model's constructor.
        """
        return dataclasses.asdict(self)

    def check(
        self,
        model: str = "fastlm",
        device: torch.device | str | None = None,
        name: Callable[[str], str] = str,
    ) -> None:
        """Check that `model` can run this configuration on `device`, saying what to change.

        Every field must have its type and be positive (num_kv_heads may be None); d_model must
        split into num_heads heads of an even size (RoPE rotates pairs), for fastlm's model
        where the kernels run on `device` also a multiple of 8 up to 512 (256 in fp32);
        num_kv_heads must divide num_heads; norm_eps must be at most float32's largest and
        rope_theta must give finite RoPE angles in float32.

        Args:
            model: "fastlm" (the default) or "reference".
            device: where the model would run (default None: PyTorch's default device).
            name: spells a field in the message (default `str`; the commands pass their flags).

        Raises:
            ValueError: naming the field, for a configuration the model cannot run.
        """
        for field in MODEL_FIELDS:
            value = getattr(self, field)
            if field in MOE_DEFAULTS:  # checked together below
                continue
            if field in ("rope_theta", "norm_eps"):
                try:  # the rule of every numeric option, its type errors a ValueError here
                    check(name(field), value, spec=ALIASES[field])
                except TypeError as error:
                    raise ValueError(str(error)) from None
            elif field in ("rope_interleaved", "tie_embeddings"):
                if not isinstance(value, bool):
                    raise ValueError(f"{name(field)} must be true or false, got {value!r}")
            elif field == "num_kv_heads" and value is None:
                pass
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name(field)} must be a positive integer, got {value!r}")
        moe = {field: getattr(self, field) for field in MOE_DEFAULTS}
        try:  # the option rule, its type errors a ValueError here (as for rope_theta)
            reference.check_moe_options(**moe, num_layers=self.num_layers, name=name)
        except TypeError as error:
            raise ValueError(str(error)) from None
        if model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
        # The reference needs the same split into heads of an even size (RoPE rotates pairs);
        # fastlm's attention kernel, where it runs, also a range of head dims.
        kernels = model == "fastlm" and kernels_run_on(device)
        check_heads(self.d_model, self.num_heads, kernels, name)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{name('num_heads')} {self.num_heads} must be a multiple of "
                f"{name('num_kv_heads')} {self.num_kv_heads}"
            )

    def num_parameters(self) -> int:
        """The parameter count of either model of this configuration (a tied output projection
        counted once), computed without building one.

        Returns:
            The number of parameters.
        """
        return self._count(self.num_experts)

    def active_parameters(self) -> int:
        """The parameters one token's forward uses: `num_parameters` with each mixture-of-experts
        layer's experts_per_token experts in place of all of them (the router counted).

        Returns:
            The number of active parameters (num_parameters for a dense model).
        """
        return self._count(self.experts_per_token if self.num_experts else 0)

    def _count(self, experts: int) -> int:
        """Parameters with `experts` routed experts in each mixture-of-experts layer."""
        d, head_dim = self.d_model, self.d_model // self.num_heads
        kv_heads = self.num_kv_heads or self.num_heads
        attention = d * (self.num_heads + 2 * kv_heads) * head_dim + d * d
        dense = attention + 3 * d * self.d_ff + 2 * d  # + SwiGLU's three matrices, two norms
        blocks = self.num_layers * dense
        if self.num_experts:  # the feed-forward of each MoE layer: experts, shared, router
            widths = (experts + self.num_shared_experts) * (self.moe_d_ff or self.d_ff)
            moe = dense - 3 * d * self.d_ff + 3 * d * widths + self.num_experts * d
            blocks += (self.num_layers - self.first_dense_layers) * (moe - dense)
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embeddings + blocks + d


MODEL_FIELDS = tuple(field.name for field in dataclasses.fields(ModelConfig))
#: The LLaMA-style options, with their defaults: what a stored configuration may leave out.
OPTION_DEFAULTS = {
    "num_kv_heads": None,
    "rope_interleaved": True,
    "tie_embeddings": False,
    "norm_eps": 1e-5,
}
#: The mixture-of-experts options, with their defaults (the dense model).
MOE_DEFAULTS = {
    "num_experts": 0,
    "experts_per_token": 2,
    "moe_d_ff": None,
    "num_shared_experts": 0,
    "first_dense_layers": 0,
    "router": "softmax",
    "normalize_top_k": True,
    "aux_loss_coef": 0.01,
    "z_loss_coef": 0.001,
    "router_bias_rate": 0.001,
}
OPTION_DEFAULTS.update(MOE_DEFAULTS)
REQUIRED_FIELDS = tuple(name for name in MODEL_FIELDS if name not in OPTION_DEFAULTS)


def with_defaults(stored: Mapping) -> dict:
    """A stored configuration (a checkpoint's) with the defaults of the options it lacks, so that
    a checkpoint whose configuration does not name the options compares equal to one naming
    the defaults."""
    return {**OPTION_DEFAULTS, **stored}


# Each preset: the model's fields but vocab_size (the tokenizer's; options it does not name
# take their defaults, OPTION_DEFAULTS), the longest
# --context-length it accepts (max_context), and the training defaults that suit its size
# (tiny: loss 5.6 -> 1.4 nats per byte in one to two minutes on two CPU cores).
_TINY = dict(
    d_model=128,
    num_layers=4,
    num_heads=4,
    d_ff=384,
    context_length=128,
    max_context=512,
    batch_size=16,
    steps=400,
    lr=3e-3,
    eval_every=100,
    save_every=200,
)
_GPT2_SMALL = dict(
    d_model=768,
    num_layers=12,
    num_heads=12,
    d_ff=2048,
    context_length=1024,
    max_context=1024,
    batch_size=16,
    steps=5000,
    lr=6e-4,
    eval_every=250,
    save_every=1000,
)
PRESETS = {
    "tiny": _TINY,
    "gpt2-small": _GPT2_SMALL,
    # gpt2-small's size with the LLaMA-style options (Llama's layout, as Hugging Face's
    # checkpoints hold it): grouped-query attention, half-split RoPE, tied embeddings.
    "llama-small": dict(
        _GPT2_SMALL, num_kv_heads=4, rope_interleaved=False, tie_embeddings=True, norm_eps=1e-6
    ),
    # tiny's mixture-of-experts sibling: 8 experts of half tiny's d_ff, 2 per token, so each
    # token's feed-forward is as wide as tiny's (2 x 192 = 384): the same active parameters but
    # the routers' 4 x 128 x 8 = 4,096, and 4 x 6 x 3 x 128 x 192 = 1.77M more in all.
    "tiny-moe": dict(_TINY, num_experts=8, experts_per_token=2, moe_d_ff=192),
    # gpt2-small's sibling: 16 experts of half its d_ff, 2 per token: each token's feed-forward
    # is 2 x 3 x 768 x 1024 = 3 x 768 x 2048 = 4.72M per layer, gpt2-small's, so the active
    # parameters are gpt2-small's 85.35M plus the routers' 12 x 768 x 16 = 0.15M; in all
    # 12 x 14 x 3 x 768 x 1024 = 396M more (the experts a token does not use).
    "gpt2-small-moe": dict(_GPT2_SMALL, num_experts=16, experts_per_token=2, moe_d_ff=1024),
    "gpt2-medium": dict(
        d_model=1024,
        num_layers=24,
        num_heads=16,
        d_ff=2816,
        context_length=1024,
        max_context=1024,
        batch_size=8,
        steps=5000,
        lr=3e-4,
        eval_every=250,
        save_every=1000,
    ),
}


def build_model(
    config: ModelConfig, model: str = "fastlm", device: torch.device | str | None = None
) -> nn.Module:
    """`fastlm.Transformer` (model="fastlm") or `reference.Transformer` of `config`.

    Args:
        config: the model's fields.
        model: "fastlm" (the default) or "reference".
        device: where to build it (default None: PyTorch's default device); its parameters are in
            PyTorch's default dtype.

    Returns:
        The model, freshly initialised.

    Raises:
        ValueError: a configuration `model` cannot run on `device` (`ModelConfig.check`).
    """
    config.check(model, device)
    cls = Transformer if model == "fastlm" else reference.Transformer
    return cls(**config.as_dict(), device=device)


def check_integers(args: Mapping, exempt: tuple[str, ...] = ()) -> None:
    """ConfigError for a command's integer argument past 64 bits (torch's sizes and indices),
    other than those `exempt`.

    Args:
        args: the parsed arguments by name.
        exempt: names that take any integer.
    """
    for key, value in args.items():
        if isinstance(value, int) and not isinstance(value, bool) and key not in exempt:
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                bound = "at most 2**63 - 1" if value > 0 else "at least -2**63"
                raise ConfigError(
                    f"--{key.replace('_', '-')} must be {bound} (torch's integers have 64 "
                    f"bits), got {value}"
                )


def torch_seed(seed: int) -> int:
    """Any integer as a seed torch's generators take: modulo 2**64 (which is how they read a
    negative one), so seeds that differ by a multiple of 2**64 give the same draws.

    Args:
        seed: any integer.

    Returns:
        The seed in [0, 2**64).
    """
    return seed % 2**64


def pick_device(name: str | None, local_rank: int = 0) -> torch.device:
    """The device `--device` names (default: this rank's GPU when there is one, else the CPU);
    ConfigError for one that is not cpu or an existing GPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if device.index is None:  # each rank on its own GPU
            device = torch.device("cuda", local_rank)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            raise ConfigError(
                f"{device} does not exist ({count} GPUs here): pass --device cpu "
                "or a GPU that exists (under torchrun: one process per GPU)"
            )
    return device
