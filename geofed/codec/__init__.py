"""The delta codec: named float tensors to a framed, compressed, hashed stream and back.

Schemes: ``fp32`` (lossless), ``int8`` and ``int4`` (blockwise absmax; see
:mod:`geofed.codec.quantize` for the math). Encoding is deterministic for given inputs
(and generator state, with stochastic rounding; and the same ``compression`` and
``zstd_threads`` choice, see :func:`encode_stream`); decoding is bit-identical everywhere.
The parameters are :class:`geofed.codec_params.CodecParams`, the model job specs, round
announcements and manifests share; the chunk size is the encoder's own choice
(``chunk_elements``, recorded in the stream header).

Encoding is two steps, which may run apart: :func:`quantize_tensors` quantizes on the
tensors' own device (with error feedback, the new residual is computed there too) and
returns :class:`QuantizedTensors`, the chunks' payloads on the host, which
``to_state``/``from_state`` carry to another process; :func:`seal_quantized` compresses,
frames and hashes them. :func:`encode_stream` chains both chunk by chunk, to the same
bytes; :func:`dequantize` gives the values a decoder will get.

Wire format, version 2
======================

Version 2 differs from version 1 only in the chunk fields: version 1 had three reserved
zero bytes after ``scheme``; version 2 uses the first of them for ``compression`` and
keeps two reserved. Decoders read both versions; every frame of a stream carries the
version of its header, and a frame of another version is refused. Encoders write version
2.

All integers are unsigned little-endian. A stream is a sequence of frames::

    HEADER, CHUNK 0, CHUNK 1, ..., CHUNK n-1, TRAILER

Every frame is ``prefix | body | tag``:

==========  =====  ============================================================
field       bytes  meaning
==========  =====  ============================================================
magic       4      ``b"GFDC"``
version     1      2 (1 is read too)
kind        1      1 header, 2 chunk, 3 trailer
flags       2      0 (reserved)
body_len    8      bytes of body
body        ...    depends on kind
tag         32     sha256 of prefix and body
==========  =====  ============================================================

The *digest* of a frame is the sha256 of all its bytes, tag included; a manifest
records the chunks' digests in order (``Chunk.digest``, ``EncodedStream.digests``).

Header body: ASCII JSON, keys sorted, no whitespace::

    {"block_size": 128, "chunk_elements": 1048576, "scheme": "int8",
     "stochastic_rounding": false, "tensors": [[name, dtype, [sizes...]], ...],
     "zstd_level": 1}

``dtype`` is ``float32``, ``float16`` or ``bfloat16``; at most 64 MiB.

Chunk body: 72 bytes of fields, then the payload as ``compression`` says::

    index u64 | tensor u32 | scheme u8 (0 fp32, 1 int8, 2 int4) |
    compression u8 (0 zstd, 1 none) | reserved u16 (0) |
    offset u64 | count u64 | decoded_size u64 | header digest (32 bytes)

- ``compression`` 0: one zstd frame that declares its content size, which must be
  ``decoded_size``; decompression stops there (a frame claiming, hiding or producing more
  is refused unexpanded), and the frame may weigh at most zstd's compress bound of the
  largest payload the stream's chunks can hold.
- ``compression`` 1: the payload itself, exactly ``decoded_size`` bytes.

A version 1 chunk must have 0 there (it is always zstd). Other codes, a non-zero reserved
field, or a payload of another size are refused (:class:`CorruptChunk`) before anything
is allocated for them. Which chunks are compressed is the encoder's choice (by default
those where zstd pays: :mod:`geofed.codec.compression`); the header's ``zstd_level`` is the
level of those that are.

Chunks follow the tensors in header order; each tensor (flattened, row-major) is cut
into ``chunk_elements``-sized slices, the last one shorter; empty tensors have none. The
layout is implied by the header, so the decoder knows every chunk's index, tensor,
offset, count and exact decoded size before reading it. The decoded payload is:

- fp32: ``count`` float32 values;
- int8: ``ceil(count / block_size)`` bfloat16 scales, then ``count`` int8 codes;
- int4: the scales, then ``ceil(count / 2)`` bytes, element ``2i`` in the low nibble and
  ``2i + 1`` in the high nibble, each nibble ``code + 8``; the spare nibble of an odd
  count is ignored.

Blocks start at the beginning of each chunk (``chunk_elements`` is a multiple of
``block_size``); element ``j`` decodes to ``code_j * scale_{j // block_size}`` in
float32.

Trailer body: 56 bytes::

    chunk_count u64 | total_elements u64 | total_bytes u64 (header and chunk frames) |
    stream digest (32 bytes: sha256 of the header digest and every chunk digest in order)
"""

from geofed.codec.assembly import decode, decode_pieces
from geofed.codec.decoder import Piece, StreamDecoder
from geofed.codec.encoder import Chunk, EncodedStream, encode, encode_stream
from geofed.codec.errors import (
    CodecError,
    CorruptChunk,
    CorruptStream,
    DecodedSizeExceeded,
    DecodeError,
    DecoderStateError,
    DigestMismatch,
    EncodeError,
    InvalidConfig,
    NonFiniteValue,
    OutOfOrder,
    TruncatedStream,
    UnsupportedVersion,
)
from geofed.codec.feedback import ErrorFeedback, ErrorFeedbackError
from geofed.codec.layout import DEFAULT_CHUNK_ELEMENTS
from geofed.codec.quantized import (
    InvalidQuantized,
    QuantizedTensors,
    dequantize,
    quantize_tensors,
    seal_quantized,
    write_quantized,
)
from geofed.codec.tensors import TensorLayout

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "Chunk",
    "CodecError",
    "CorruptChunk",
    "CorruptStream",
    "DecodeError",
    "DecodedSizeExceeded",
    "DecoderStateError",
    "DigestMismatch",
    "EncodeError",
    "EncodedStream",
    "ErrorFeedback",
    "ErrorFeedbackError",
    "InvalidConfig",
    "InvalidQuantized",
    "NonFiniteValue",
    "OutOfOrder",
    "Piece",
    "QuantizedTensors",
    "StreamDecoder",
    "TensorLayout",
    "TruncatedStream",
    "UnsupportedVersion",
    "decode",
    "decode_pieces",
    "dequantize",
    "encode",
    "encode_stream",
    "quantize_tensors",
    "seal_quantized",
    "write_quantized",
]
