"""Byte-level language model on the Python standard library's source, split by package.

Job configs name it ``geofed.examples.charlm:CharLMTask``.
"""

from geofed.examples.charlm.data import TokenBatch
from geofed.examples.charlm.task import CharLMOptions, CharLMTask

__all__ = ["CharLMOptions", "CharLMTask", "TokenBatch"]
