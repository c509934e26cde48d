"""One rule for the numeric options of every public function and op of fastlm.

A numeric option (a softcap, an epsilon, a window side, a sampling setting) is accepted when it is

- a number of its kind: a real number (an int or a float) for a real option, an int for an integer
  one; a bool, a str, a tensor or any other object is a TypeError naming the option;
- finite, and for a real option within float32's range (the kernels compute in float32: a value
  that rounds to inf there would turn the result into NaN or 0 silently): nan, +-inf and larger
  magnitudes are a ValueError naming the option;
- inside its range, `OPTIONS[name]`: otherwise a ValueError naming the option and the range.

Nothing is clamped or replaced. Some options also take None ("not set"), said per function.
A tensor option (attention `sinks`, one value per head) has its range here too, for each element
as float32 holds it (the dtype the kernels compute in: a float64 1e300 is inf there), and its own
checker beside its function (`fastlm.kernels.attention.ops.check_sinks`).
Each public function calls `check(name, value)` for each of its numeric options before anything
else, on both backends, and the ops (`torch.ops.fastlm.*`) check their float arguments the same
way, so a value that the public function refuses is refused there too. `docs/options.md` is the
table of ranges; `tests/test_options.py` tries every option of every function with nan, +-inf, a
negative, 0, a huge value and the wrong types. A new option: add its range here, call `check`
in its function, and register the function's option in the test (which fails until it is).

This module imports nothing of fastlm, so every module may use it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

#: float32's largest finite value: the kernels take real options as float32.
FLOAT32_MAX = 3.4028234663852886e38
#: The largest int32: window sides, chunk sizes and lengths are int32 inside the kernels.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: The widest window side: the kernels add it to a position in int32, so that a position below
#: 2**30 (any sequence that fits in memory) plus it stays below 2**31. A wider side: -1.
WINDOW_MAX = 2**30
#: The bound of an option that scales float32 values (a cap, a weight, a scale, an offset): far
#: above any use, and low enough that the values it scales stay inside float32's range (and a
#: cap's x / c above its smallest normal, which a GPU may flush to 0).
BIG = 1e6
#: The largest attention sink: the attention kernels hold scores and sinks in base 2 (x * log2(e))
#: in float32, so a larger sink (float32 holds up to 3.4e38) would be inf there.
SINK_MAX = FLOAT32_MAX * math.log(2)


@dataclass(frozen=True)
class Range:
    """The values an option accepts: [low, high] (low excluded when `low_open`), of `kind`."""

    kind: type  # float (any real number) or int
    low: float
    high: float
    low_open: bool = False
    meaning: str = ""  # what its special values do, for the docs ("0: off")

    def describe(self) -> str:
        def bound(x):
            names = {FLOAT32_MAX: "3.4e38", -FLOAT32_MAX: "-3.4e38", INT32_MAX: "2**31 - 1",
                     WINDOW_MAX: "2**30", BIG: "1e6", -BIG: "-1e6",
                     INT64_MAX: "2**63 - 1", INT64_MIN: "-2**63",
                     SINK_MAX: "3.4e38 * ln 2", -SINK_MAX: "-3.4e38 * ln 2"}  # fmt: skip
            return names.get(x, f"{x:g}")

        kind = "a finite number" if self.kind is float else "an int"
        return f"{kind} in {'(' if self.low_open else '['}{bound(self.low)}, {bound(self.high)}]"


def _real(low: float, high: float = FLOAT32_MAX, low_open: bool = False, meaning: str = ""):
    return Range(float, low, high, low_open, meaning)


def _int(low: int, high: int = INT32_MAX, meaning: str = ""):
    return Range(int, low, high, False, meaning)


#: Every numeric option of fastlm's public functions and ops, by name.
OPTIONS: dict[str, Range] = {
    "softcap": _real(0.0, BIG, meaning="c * tanh(x / c) caps x; 0 is off"),
    "label_smoothing": _real(0.0, 1.0, meaning="PyTorch's; 0 is off"),
    "z_loss": _real(0.0, BIG, meaning="weight of lse^2; 0 is off"),
    "eps": _real(0.0, low_open=True, meaning="added to the mean square"),
    "offset": _real(-BIG, BIG, meaning="added to the weight (1 is Gemma's norm)"),
    "alpha": _real(0.0, BIG, low_open=True, meaning="the sigmoid's slope (1 is SiLU)"),
    "limit": _real(0.0, BIG, low_open=True, meaning="None: no clamp (gpt-oss: 7)"),
    "up_offset": _real(-BIG, BIG, meaning="added to the clamped up (gpt-oss: 1)"),
    # 0 and negative scales are the kernels' (tests/test_attention.py::test_softmax_scale).
    "softmax_scale": _real(-BIG, BIG, meaning="None: 1 / sqrt(head dim); 0: equal weights"),
    "window_size": _int(-1, WINDOW_MAX, meaning="each side of (left, right); -1 is unbounded"),
    "chunk_size": _int(1, meaning="tokens per chunk; None: the default"),
    "temperature": _real(0.0, meaning="0 is greedy"),
    "top_p": _real(0.0, 1.0, low_open=True, meaning="None (or 1) keeps every token"),
    "top_k": _int(1, INT64_MAX, meaning="None keeps every token; above the vocabulary: all"),
    "theta": _real(1.0, meaning="RoPE's base (below 1 the angles outgrow float32)"),
    "ignore_index": _int(INT64_MIN, INT64_MAX, meaning="any int; targets equal to it add 0"),
    "max_seqlen": _int(0, meaning="the longest sequence of a packed batch"),
    "num_kv_heads": _int(1, meaning="None: as many as query heads"),
    "vocab_size": _int(1, INT64_MAX, meaning="None: the model's"),
    "max_new_tokens": _int(0, INT64_MAX, meaning="0 draws nothing"),
    # A model's mixture of experts (`reference.check_moe_options` adds how they relate).
    "num_experts": _int(0, meaning="0: a dense model"),
    "experts_per_token": _int(1, meaning="at most num_experts"),
    "num_shared_experts": _int(0, meaning="dense experts every token takes"),
    "first_dense_layers": _int(0, meaning="below num_layers"),
    "aux_loss_coef": _real(0.0, BIG, meaning="the balance loss's weight; 0 is off"),
    "z_loss_coef": _real(0.0, BIG, meaning="the router z-loss's weight; 0 is off"),
    "router_bias_rate": _real(0.0, BIG, meaning="the selection bias's step; 0: it stays"),
    # A tensor, each element as float32 holds it; -inf (no sink for that head) is allowed too.
    "sinks": _real(-SINK_MAX, SINK_MAX, meaning="-inf: no sink for that head"),
}
#: Other spellings of the same option (a model's `norm_eps` is its norms' eps).
ALIASES = {"norm_eps": "eps", "rope_theta": "theta", "max_seqlen_q": "max_seqlen",
           "max_seqlen_k": "max_seqlen", "window_left": "window_size",
           "window_right": "window_size"}  # fmt: skip


def check(name: str, value: object, *, none_ok: bool = False, spec: str | None = None):
    """`value` of the option `name` checked by the rule above, as a Python float or int.

    Args:
        name: the option's name, as the message spells it (`window_size[0]`, `--rope-theta`).
        value: what the caller passed.
        none_ok: None is accepted (and returned) as "not set".
        spec: the key of `OPTIONS` when `name` is not one (default: `name`, or its alias).

    Raises:
        TypeError: a value that is not a number of the option's kind (a bool, a str, a tensor).
        ValueError: nan, +-inf, or a value outside the option's range.
    """
    if value is None and none_ok:
        return None
    key = spec or ALIASES.get(name, name)
    allowed = OPTIONS[key]
    wanted = "an int" if allowed.kind is int else "a real number (int or float)"
    if allowed.kind is int:
        ok_type = isinstance(value, numbers.Integral)
    else:
        ok_type = isinstance(value, numbers.Real)
    if isinstance(value, bool) or not ok_type:
        none = " or None" if none_ok else ""
        raise TypeError(f"{name} must be {wanted}{none}, got {type(value).__name__}")
    number = int(value) if allowed.kind is int else float(value)
    inside = allowed.low < number if allowed.low_open else allowed.low <= number
    if not (math.isfinite(number) and inside and number <= allowed.high):
        raise ValueError(f"{name} must be {allowed.describe()}, got {value!r}")
    return number


def check_flag(name: str, value: object) -> bool:
    """`value` of the switch `name` (an on/off option: `softcap_approx`, `return_lse`): a bool,
    and nothing else (not 0 or 1, not a string, not a tensor), or a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
