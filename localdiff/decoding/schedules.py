"""Temperature schedules for the denoising steps."""

from __future__ import annotations

import torch


def linear_temperature(steps_remaining: int, max_steps: int, t_min: float, t_max: float) -> torch.Tensor:
    """Linear schedule t = t_min + (t_max - t_min) * (n / N), where n counts the steps *remaining* (N at the first
    step, 1 at the last), as in transformers' ``LinearTemperatureScheduleLogitsProcessor``.

    Returns a 0-d float32 tensor computed with the reference's dtypes so ``logits / t`` is bit-identical.
    """
    n = torch.tensor(steps_remaining, dtype=torch.int32)
    return t_min + (t_max - t_min) * (n / max_steps)
