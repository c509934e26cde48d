"""Training metrics to TensorBoard or Weights & Biases (`fastlm-train --log`).

- "tensorboard": torch's `SummaryWriter`, event files in the log folder
  (`tensorboard --logdir DIR`; `pip install fastlm[tensorboard]`).
- "wandb": a Weights & Biases run in the log folder (`pip install fastlm[wandb]`). Offline unless
  WANDB_API_KEY is set or WANDB_MODE says otherwise: training never waits on a network, and
  `wandb sync DIR/wandb/offline-run-*` uploads the run later.

A package that is missing is a ConfigError before training starts. Logging never stops training:
a logger that fails later (a full disk, a lost connection) warns once and is dropped, and the
others, the JSON summary and loss.png go on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from fastlm.config import ConfigError

LOGGERS = ("tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_available(kinds: list[str]) -> None:
    """ConfigError naming what to install for a logger whose package is missing."""
    for kind in kinds:
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            else:
                import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"--log {kind} needs the {PACKAGES[kind]} package: pip install 'fastlm[{kind}]'"
            ) from None


class _TensorBoard:
    def __init__(self, folder: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, folder: Path, config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fastlm"),
            name=os.environ.get("WANDB_NAME", folder.name),
            dir=str(folder),
            config=config,
            mode=mode,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def flush(self) -> None:
        pass  # wandb writes in its own process

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """The loggers of `kinds`, each writing into `folder`; failures warn once (via `warn`)."""

    def __init__(
        self, kinds: list[str], folder: Path, config: dict, warn: Callable[[str], None]
    ) -> None:
        self.warn, self.loggers = warn, {}
        for kind in dict.fromkeys(kinds):
            backend = _TensorBoard if kind == "tensorboard" else _WandB
            try:
                self.loggers[kind] = backend(folder, config)
            except Exception as error:  # whatever the logger raises: training goes on
                self._drop(kind, error)

    def _drop(self, kind: str, error: Exception) -> None:
        self.loggers.pop(kind, None)
        self.warn(
            f"warning: the {kind} logger failed ({type(error).__name__}: {error}); "
            "training goes on without it"
        )

    def log(self, metrics: dict[str, float | None], step: int, flush: bool = False) -> None:
        """`metrics` (None values left out) at `step`; flush: written to disk now."""
        metrics = {name: float(value) for name, value in metrics.items() if value is not None}
        for kind, logger in list(self.loggers.items()):
            try:
                logger.log(metrics, step)
                if flush:
                    logger.flush()
            except Exception as error:
                self._drop(kind, error)

    def close(self) -> None:
        for kind, logger in list(self.loggers.items()):
            try:
                logger.close()
            except Exception as error:
                self._drop(kind, error)
        self.loggers.clear()
