"""Named sizes of the Llama example, from a CPU test model to a billion parameters.

With a 256-byte vocabulary the embeddings are negligible, so the sizes come from depth
and width alone; each preset's name is its parameter count, rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

PresetName = Literal["tiny", "125m", "350m", "1b"]


@dataclass(frozen=True, slots=True)
class Preset:
    """The architecture sizes a preset fixes (a task's options may override each)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int


PRESETS: Final[dict[PresetName, Preset]] = {
    # ~1.05M parameters: a few milliseconds a step on a CPU core.
    "tiny": Preset(dim=128, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=384),
    # ~126M
    "125m": Preset(dim=768, n_layers=20, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    # ~352M
    "350m": Preset(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    # ~1.04B
    "1b": Preset(dim=2048, n_layers=22, n_heads=16, n_kv_heads=8, ffn_dim=5632),
}
