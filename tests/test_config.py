"""fastlm.config: model configurations, presets, building either model, the devices the commands
accept; and the package's public names for sampling and the commands."""

import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fastlm
from fastlm import sampling
from fastlm.config import (
    MODEL_FIELDS,
    MODELS,
    OPTION_DEFAULTS,
    PRESETS,
    ConfigError,
    ModelConfig,
    build_model,
    pick_device,
    with_defaults,
)
from fastlm.kernels._common import HAVE_TRITON
from fastlm.kernels.attention import MAX_HEAD_DIM

# Parameters of each preset with byte tokens, as docs/training.md states them (0.9M, 85M, 309M).
PRESET_PARAMETERS = {
    "tiny": 918_656,
    "gpt2-small": 85_347_072,
    "llama-small": 75_713_280,
    "gpt2-medium": 308_855_808,
    "tiny-moe": 2_692_224,  # 922,752 active (tiny's and the routers' 4,096)
    "gpt2-small-moe": 481_856_256,  # 85,494,528 active (gpt2-small's and 147,456)
}


def preset_config(name: str, vocab_size: int = 256) -> ModelConfig:
    fields = {key: value for key, value in PRESETS[name].items() if key in MODEL_FIELDS}
    return ModelConfig(vocab_size=vocab_size, **fields)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_both_models(name):
    config = preset_config(name)
    models = {kind: build_model(config, kind, device="meta") for kind in MODELS}  # no memory
    assert isinstance(models["fastlm"], fastlm.Transformer)
    assert isinstance(models["reference"], fastlm.reference.Transformer)
    for model in models.values():
        assert sum(p.numel() for p in model.parameters()) == PRESET_PARAMETERS[name]
    assert config.num_parameters() == PRESET_PARAMETERS[name]  # counted without a model
    assert models["fastlm"].state_dict().keys() == models["reference"].state_dict().keys()


def test_config_round_trips_through_a_checkpoint_dict():
    config = preset_config("tiny")
    stored = {**config.as_dict(), "tokenizer": "bytes"}  # what a checkpoint keeps
    assert ModelConfig.from_dict(stored) == config
    assert tuple(config.as_dict()) == MODEL_FIELDS
    with pytest.raises(KeyError, match="lacks d_ff, rope_theta"):
        ModelConfig.from_dict({k: v for k, v in stored.items() if k not in ("d_ff", "rope_theta")})
    llama = preset_config("llama-small")
    assert ModelConfig.from_dict({**llama.as_dict(), "tokenizer": "bytes"}) == llama
    assert (llama.num_kv_heads, llama.rope_interleaved, llama.tie_embeddings) == (4, False, True)


def test_checkpoints_from_before_the_options_have_their_defaults():
    """A configuration stored before num_kv_heads, rope_interleaved, tie_embeddings and norm_eps
    existed reads as the model it was: the defaults."""
    config = preset_config("tiny")
    old = {k: v for k, v in config.as_dict().items() if k not in OPTION_DEFAULTS}
    assert ModelConfig.from_dict(old) == config
    assert with_defaults(old) == config.as_dict()
    assert (config.num_kv_heads, config.rope_interleaved, config.tie_embeddings) == (
        None,
        True,
        False,
    )
    assert config.norm_eps == 1e-5


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(num_layers=2.5), "num_layers must be a positive integer, got 2.5"),
        (dict(context_length=True), "context_length must be a positive integer, got True"),
        (dict(rope_theta=0.0), "rope_theta must be a finite number in [1, 3.4e38], got 0.0"),
        (
            dict(rope_theta=float("nan")),
            "rope_theta must be a finite number in [1, 3.4e38], got nan",
        ),
        (dict(rope_theta="1e4"), "rope_theta must be a real number (int or float), got str"),
        (dict(norm_eps=0.0), "norm_eps must be a finite number in (0, 3.4e38], got 0.0"),
        # float32 (the kernels' and the reference's math) cannot hold these.
        (dict(norm_eps=1e300), "norm_eps must be a finite number in (0, 3.4e38], got 1e+300"),
        # Below 1 the frequencies theta^(-2i/d) outgrow 1, and soon float32 (fastlm.options).
        (dict(rope_theta=1e-40), "rope_theta must be a finite number in [1, 3.4e38], got 1e-40"),
        (dict(num_kv_heads=0), "num_kv_heads must be a positive integer, got 0"),
        (dict(num_kv_heads=3), "num_heads 4 must be a multiple of num_kv_heads 3"),
        (dict(rope_interleaved=1), "rope_interleaved must be true or false, got 1"),
        (dict(tie_embeddings="yes"), "tie_embeddings must be true or false, got 'yes'"),
        (dict(d_model=100, num_heads=3), "d_model 100 must be a multiple of num_heads 3"),
        (
            dict(d_model=96, num_heads=32),
            "d_model 96 / num_heads 32 gives heads of 3 dims, but RoPE",
        ),
    ],
)
def test_bad_config_names_the_field(change, message):
    config = ModelConfig(**{**preset_config("tiny").as_dict(), **change})
    for kind in MODELS:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_model(config, kind, device="meta")


@pytest.mark.skipif(not HAVE_TRITON, reason="FASTLM_BACKEND=triton needs the triton package")
def test_head_dims_for_the_kernels_only_where_they_run(monkeypatch):
    config = ModelConfig(**{**preset_config("tiny").as_dict(), "d_model": 48, "num_heads": 4})
    monkeypatch.setenv("FASTLM_BACKEND", "triton")
    message = (
        "d_model 48 / num_heads 4 gives heads of 12 dims, but fastlm's attention kernel "
        f"takes multiples of 8 up to {MAX_HEAD_DIM}: change d_model or num_heads (with d_model 48: "
        "num_heads 3), or run PyTorch's attention with FASTLM_BACKEND=torch"
    )
    with pytest.raises(ValueError) as error:
        config.check("fastlm", "cpu")
    assert str(error.value) == message
    config.check("reference", "cpu")  # the reference has no kernels
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    config.check("fastlm", "cpu")
    # The commands spell the fields as their flags.
    monkeypatch.setenv("FASTLM_BACKEND", "triton")
    with pytest.raises(ValueError, match="--d-model 48 / --num-heads 4 gives heads of 12 dims"):
        config.check("fastlm", "cpu", name=lambda field: "--" + field.replace("_", "-"))


@pytest.mark.parametrize("name", ["foo", "meta", "cuda:x", ""])
def test_devices_the_commands_refuse(name):
    with pytest.raises(ConfigError, match=f"--device must be cpu, cuda or cuda:N, got {name!r}"):
        pick_device(name)


def test_devices_the_commands_accept():
    assert pick_device("cpu") == torch.device("cpu")
    default = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert pick_device(None) == default
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=rf"cuda:{count} does not exist \({count} GPUs here\)"):
        pick_device(f"cuda:{count}")


# In a fresh process: what `import fastlm` offers, and what loading a command's module adds.
NAMES = """
import json, sys, fastlm
commands_before = sorted(m for m in sys.modules if m.startswith("fastlm.cli"))
sample = fastlm.sample
import fastlm.cli.generate
print(json.dumps({"commands_before": commands_before,
                  "sample": sample.__module__ + "." + sample.__name__,
                  "generate": hasattr(fastlm, "generate"),
                  "modules": sorted(m for m in sys.modules if m.startswith("fastlm."))}))
"""


def test_sampling_has_one_public_name_and_the_commands_live_in_cli():
    """`fastlm.sample` is the sampling function; the commands are modules of `fastlm.cli`, which
    `import fastlm` does not load, and no `fastlm.generate` name stands beside `fastlm.sample`."""
    result = subprocess.run(
        [sys.executable, "-c", NAMES],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    names = json.loads(result.stdout)
    assert names["commands_before"] == []
    assert names["sample"] == "fastlm.sampling.sample" and fastlm.sample is sampling.sample
    assert not names["generate"]
    assert "fastlm.cli.generate" in names["modules"] and "fastlm.cli.train" not in names["modules"]


def test_backend_names_the_module_only(monkeypatch):
    """`fastlm.backend` is the module of the backend rule, also after `import fastlm` (no
    function of that name on the package hides it); `selected()` says what FASTLM_BACKEND asks
    for."""
    import fastlm.backend as backend

    assert inspect.ismodule(backend) and fastlm.backend is backend
    assert backend.use_triton is fastlm.use_triton
    for choice in ("auto", "triton", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", choice)
        assert backend.selected() == choice
    monkeypatch.delenv("FASTLM_BACKEND")
    assert backend.selected() == "auto"
