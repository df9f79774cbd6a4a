"""A Llama-style causal decoder in plain torch.

Pre-norm blocks of RMSNorm, grouped-query attention with rotary position embeddings and
a SwiGLU feed-forward. The rotary table ``freqs_cis`` is a persistent complex64 buffer
(as torchtitan registers it): it is in ``state_dict()`` but outside the federated state,
and every side's ``build_model`` rebuilds it from the architecture alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture: every size a :class:`Llama` is built from."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dimension {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def parameter_count(self) -> int:
        """The number of parameters of a :class:`Llama` of this config, without building it."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        feed_forward = 3 * self.dim * self.ffn_dim
        block = attention + feed_forward + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + embeddings + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per non-embedding weight plus attention's scores.

        The attention term ``12 · layers · dim · seq_len`` counts the forward's two
        ``seq_len``-long matmuls per head and their backward.
        """
        dense = self.parameter_count() - self.vocab_size * self.dim
        return 6.0 * dense + 12.0 * self.n_layers * self.dim * seq_len


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned gain, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = normed.type_as(x) * self.weight
        return out


def rotary_table(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """The complex64 ``(length, head_dim / 2)`` rotations of rotary position embeddings."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, time, heads, head_dim)`` by the first ``time`` rotations."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs_cis[: x.shape[1], None, :]).flatten(3)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_kv_heads`` key/value heads shared by groups."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, t, self.n_heads, self.head_dim), freqs_cis)
        k = apply_rotary(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), freqs_cis)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        out: torch.Tensor = self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        return out


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) · w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """Attention then feed-forward, each around a pre-RMSNorm residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Llama(nn.Module):
    """Maps token ids ``(batch, time)`` to next-token logits ``(batch, time, vocab)``."""

    freqs_cis: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # Tied embeddings reuse the embedding matrix in forward rather than aliasing it as
        # a second parameter, so the state names every tensor once.
        self.output = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        self.register_buffer(
            "freqs_cis",
            rotary_table(config.head_dim, config.max_seq_len, config.rope_theta),
            persistent=True,
        )
        self._init_weights()

    def _init_weights(self) -> None:
        # Small weights make the first loss ~ln(vocab); the projections back into the
        # residual stream shrink with depth so it stays O(1).
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith((".wo", ".w2"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else 0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than max_seq_len {self.config.max_seq_len}"
            )
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs_cis)
        x = self.norm(x)
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        logits: torch.Tensor = self.output(x)
        return logits
