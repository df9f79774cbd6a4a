"""A Llama-style decoder on the byte corpus, sized by preset from ~1M to ~1B parameters.

Job configs name it ``geofed.examples.llama:LlamaTask`` with ``options: {preset: tiny}``
(or ``125m``, ``350m``, ``1b``, and any size overridden).
"""

from geofed.examples.llama.model import Llama, LlamaConfig
from geofed.examples.llama.presets import PRESETS, Preset, PresetName
from geofed.examples.llama.task import LlamaOptions, LlamaTask

__all__ = ["PRESETS", "Llama", "LlamaConfig", "LlamaOptions", "LlamaTask", "Preset", "PresetName"]
