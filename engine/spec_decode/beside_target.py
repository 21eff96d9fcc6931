"""What a drafting model (a draft model, an EAGLE-3 head) needs of its target: it keeps its K/V
in the target's block ids, beside the target on one rank."""

from __future__ import annotations

from config import ConfigError, EngineConfig
from engine.loading.model_spec import ModelSpec


def refusal(config: EngineConfig, why: str) -> ConfigError:
    """A start-up error naming the speculative config's 'model' key."""
    spec = config.scheduler.speculative_config
    name = spec.model if spec is not None else None
    return ConfigError(f"--speculative-config key 'model' ({name!r}): {why}")


def check_target(config: EngineConfig, target: ModelSpec, what: str) -> None:
    """`what` (the draft, the head) can run beside this target: one rank, and no block freed
    behind a sliding window while `what` still attends to it."""
    if target.tensor_parallel_size > 1:
        raise refusal(
            config,
            f"{what} runs beside its target on one rank, not under --tensor-parallel-size > 1",
        )
    windows = target.info.sliding_windows
    if None not in windows and max(w for w in windows if w is not None) < target.max_model_len:
        # The target frees the blocks behind its widest window, and their K/V of `what` with
        # them, which attends to all of its context.
        raise refusal(
            config,
            "the target attends through a sliding window on every layer, narrower than "
            f"--max-model-len: it frees blocks that hold {what}'s K/V",
        )
