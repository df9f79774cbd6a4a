"""Byte-level language model on the Python standard library's source, split by package.

Job configs name it ``geofed.examples.charlm:CharLMTask``.
"""

from geofed.examples.charlm.task import CharLMOptions, CharLMTask, TokenBatch

__all__ = ["CharLMOptions", "CharLMTask", "TokenBatch"]
