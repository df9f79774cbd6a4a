"""Exceptions raised by the delta codec.

Every error names what is wrong (which tensor, which chunk, which field) so that a
rejected upload can be explained to its sender without a debugger. The base
:class:`CodecError` and :class:`InvalidConfig` are defined with the codec parameters
(:mod:`geofed.codec_params`), which validate without importing the codec.
"""

from __future__ import annotations

from geofed.codec_params import CodecError, InvalidConfig

__all__ = [
    "CodecError",
    "CorruptChunk",
    "CorruptStream",
    "DecodeError",
    "DecodedSizeExceeded",
    "DecoderStateError",
    "DigestMismatch",
    "EncodeError",
    "InvalidConfig",
    "NonFiniteValue",
    "OutOfOrder",
    "TruncatedStream",
    "UnsupportedVersion",
]


class EncodeError(CodecError, ValueError):
    """The tensors given to the encoder cannot be encoded (bad dtype, NaN/Inf, ...)."""


class NonFiniteValue(EncodeError):
    """A tensor holds NaN or Inf; a delta must be finite."""


class DecodeError(CodecError, ValueError):
    """A stream cannot be decoded; nothing decoded from it should be used."""


class UnsupportedVersion(DecodeError):
    """A frame has an unknown magic or wire-format version."""


class CorruptStream(DecodeError):
    """A frame fails its integrity or consistency checks."""


class CorruptChunk(CorruptStream):
    """A chunk frame fails its hash, its fields or its payload checks."""


class DigestMismatch(CorruptStream):
    """A frame's sha256 differs from the digest the manifest recorded for it."""


class OutOfOrder(DecodeError):
    """A chunk arrived with a sequence number other than the next expected one."""


class TruncatedStream(DecodeError):
    """The stream ended (or its trailer arrived) before every chunk was read."""


class DecodedSizeExceeded(DecodeError):
    """A declared decoded size exceeds the bound the decoder accepts."""


class DecoderStateError(CodecError):
    """The decoder was used out of sequence (fed after finish, iterator not drained)."""
