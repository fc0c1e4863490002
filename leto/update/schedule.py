"""Learning-rate schedule of the paper's appendix A.1: linear warm-up over the first
10% of iterations to the peak, then cosine decay to a floor of peak/10 at the end."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    peak_lr: float = 2.2e-4
    total_iters: int = 1000
    warmup_frac: float = 0.10
    floor_frac: float = 0.10

    def __call__(self, iteration: int) -> float:
        warm = max(1, int(self.total_iters * self.warmup_frac))
        if iteration < warm:
            return self.peak_lr * (iteration + 1) / warm
        floor = self.peak_lr * self.floor_frac
        span = max(1, self.total_iters - warm)
        progress = min(1.0, (iteration - warm) / span)
        return floor + 0.5 * (self.peak_lr - floor) * (1 + math.cos(math.pi * progress))
