"""The outer optimizer: turns the averaged pseudo-gradient into the next global parameters.

The math lives in the shared core (:mod:`geofed.outer_step`), since a region under
``overlap_start: eager`` replays it (:mod:`geofed.eager_start`); this module is the
coordinator's name for it.
"""

from __future__ import annotations

from geofed.outer_step import OuterOptimizer, OuterOptimizerConfig, OuterOptimizerError

__all__ = ["OuterOptimizer", "OuterOptimizerConfig", "OuterOptimizerError"]
