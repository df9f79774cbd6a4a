"""Each region's own training data, read deterministically as packed token blocks.

A :class:`DatasetLocation` names a dataset on the region's disks (a directory, file or
glob of parquet, JSON lines, text or flat token files); :func:`dataset_files` lists its
files in one order. Text is read by :func:`iter_documents` and tokenized once into a
cache every rank shares (:func:`build_token_cache`). :class:`TokenBlocks` cuts flat token
files into blocks of ``seq_len + 1`` tokens; :func:`split` holds the last ones out for
validation, and :func:`batch_indices` picks each rank's training blocks at each step as a
pure function of the seed, the shard and the step. :func:`dataset_fingerprint` is what a
region says of a dataset off the region (never a path or content).
"""

from geofed.data.blocks import TokenBlocks, batch_indices, split, validation_batches
from geofed.data.documents import iter_documents
from geofed.data.fingerprint import dataset_fingerprint
from geofed.data.location import DataError, DataFormat, DatasetLocation, dataset_files
from geofed.data.token_cache import Encode, build_token_cache, cache_key, read_cache_dtype

__all__ = [
    "DataError",
    "DataFormat",
    "DatasetLocation",
    "Encode",
    "TokenBlocks",
    "batch_indices",
    "build_token_cache",
    "cache_key",
    "dataset_files",
    "dataset_fingerprint",
    "iter_documents",
    "read_cache_dtype",
    "split",
    "validation_batches",
]
