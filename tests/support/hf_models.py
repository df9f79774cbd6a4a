"""Tiny Hugging Face models, a tokenizer and data files, made on the spot (nothing is
downloaded): model directories written by ``save_pretrained`` from ``transformers``
config classes, a byte-level BPE tokenizer trained with ``tokenizers`` on the CPython
standard library's sources, and parquet, JSON lines and token files of that text."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = ("llama", "qwen2", "gpt2")
VOCAB = 384


def stdlib_texts(count: int, *, skip: int = 0) -> list[str]:
    """``count`` of the standard library's modules' sources, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[skip : skip + count]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def save_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer of ``VOCAB`` tokens with ``<eos>``, saved for
    ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_texts(20), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(directory)
    return directory


def model_config(kind: str, *, vocab: int = VOCAB) -> Any:
    """A two-layer config of architecture ``kind`` (``ARCHITECTURES``)."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=0
        )
    decoders = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    if kind not in decoders:
        raise ValueError(kind)
    return decoders[kind](
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=0,
    )


def save_model(directory: Path, kind: str = "llama", *, seed: int = 7) -> Path:
    """A randomly initialised model of ``kind`` saved with ``save_pretrained`` (its
    weights are what a pretrained start reads)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(kind))
    model.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: texts}), path)
    return path


def write_tokens(path: Path, count: int, *, vocab: int = VOCAB, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rng.integers(0, vocab, size=count, dtype=np.uint16).tofile(path)
    return path
