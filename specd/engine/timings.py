"""Where an engine's time goes, stage by stage: the public step statistics benchmarks read
(no wrapping of engine methods needed)."""

from __future__ import annotations

import time

STAGES = ("schedule", "draft", "mask", "forward", "verify", "commit")  # mask: grammars (specd.engine.constraints)


class StageTimings:
    """Totals since the last ``reset()``: steps that ran a batch, and per stage (plus ``step``, the
    whole step) wall seconds (``perf_counter``) and the engine thread's CPU seconds
    (``thread_time``: on a shared machine it excludes time spent waiting for a core)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.wall = dict.fromkeys((*STAGES, "step"), 0.0)
        self.cpu = dict.fromkeys((*STAGES, "step"), 0.0)

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def add(self, stage: str, since: tuple[float, float]) -> tuple[float, float]:
        """Charge the time since ``since`` to ``stage``; returns the new mark."""
        t = self.now()
        self.wall[stage] += t[0] - since[0]
        self.cpu[stage] += t[1] - since[1]
        return t

    def as_dict(self) -> dict:
        """``{"steps", "wall_s": {stage: s}, "cpu_s": {stage: s}, "wall_ms_per_step": {...}}``."""
        n = max(1, self.steps)
        return {
            "steps": self.steps,
            "wall_s": dict(self.wall),
            "cpu_s": dict(self.cpu),
            "wall_ms_per_step": {k: 1e3 * v / n for k, v in self.wall.items()},
            "cpu_ms_per_step": {k: 1e3 * v / n for k, v in self.cpu.items()},
        }
