"""A small causal byte-level transformer (pre-LayerNorm GPT blocks, pure torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from torch import nn

from geofed.examples.charlm.data import VOCAB_SIZE


class Block(nn.Module):
    """Causal self-attention then a GELU MLP, each around a pre-norm residual."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        out: torch.Tensor = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return out


class CharTransformer(nn.Module):
    """Maps byte ids ``(batch, time)`` to next-byte logits ``(batch, time, 256)``.

    The state holds parameters only (no buffers), so its ``state_dict`` is exactly what
    the federation averages.
    """

    def __init__(
        self, *, d_model: int, n_layers: int, n_heads: int, d_ff: int, max_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2 initialisation: small weights make the first loss ~ln(256); residual
        # projections are scaled down with depth so the residual stream stays O(1).
        residual_std = 0.02 / math.sqrt(2 * n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith((".proj", ".out"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} bytes is longer than max_len {self.max_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits
