"""The built-in GPT: a small GPT-2-style decoder that ``demo`` and ``bench`` train.

Token embeddings tied to the LM head, learned positions, pre-LayerNorm blocks in an
``nn.ModuleList`` (so :func:`gds_offload.activations.layers.find_layers` finds them), causal
attention through :func:`torch.nn.functional.scaled_dot_product_attention` with one
fused QKV projection split into q/k/v *views* (three saved views of one storage: the
offloader writes it once), a GELU MLP, and dropout.

Dropout is applied to the embeddings and to each residual branch, not inside the
attention: ``dropout_p > 0`` makes SDPA fall back to the math kernel on CPU, which saves
the whole ``seq x seq`` attention matrix. With ``torch.manual_seed`` set before each
step the dropout masks are the same in every run, so losses can be compared bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gds_offload.errors import ConfigError

__all__ = [
    "GPTConfig", "GPT", "Block", "make_gpt", "synthetic_batch", "lm_loss", "DEMO_PRESETS", "DEMO_QUICK_PRESETS", "demo_preset",
    "MemoryEstimate", "estimate_memory",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the built-in GPT.

    Attributes:
        layers: decoder blocks.
        hidden: model width (``heads`` must divide it).
        heads: attention heads.
        seq: tokens per sequence (the learned position table has this many rows).
        vocab: vocabulary size (embedding and tied LM head).
        dropout: probability of the embedding and residual-branch dropouts.
    """

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 4096
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GPTConfig.{name}={value!r} must be a positive int")
        if self.hidden % self.heads:
            raise ConfigError(f"GPTConfig.hidden={self.hidden} is not divisible by heads={self.heads}; pick heads dividing hidden")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1)")

    def params(self) -> int:
        """Number of parameters of :func:`make_gpt` (tied head counted once)."""
        h = self.hidden
        block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h


class Attention(nn.Module):
    """Causal self-attention: one fused QKV projection, split into views, then SDPA."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)  # three views of one storage
        shape = (b, t, self.heads, h // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class Block(nn.Module):
    """Pre-LayerNorm decoder block: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.out = nn.Linear(4 * config.hidden, config.hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """The decoder: ``forward(tokens[b, t]) -> logits[b, t, vocab]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.seq:
            raise ConfigError(f"sequence of {t} tokens is longer than GPTConfig.seq={self.config.seq}")
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(config: GPTConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> GPT:
    """A :class:`GPT` with weights drawn from ``torch.manual_seed(seed)`` (same seed, same weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return model.to(device)


def synthetic_batch(config: GPTConfig, batch: int, seed: int, *, device: str | torch.device = "cpu") -> torch.Tensor:
    """Random tokens ``[batch, seq + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``), a function of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab, (batch, config.seq + 1), generator=gen).to(device)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on a :func:`synthetic_batch`."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


#: The demo's (``--full``; and bench's default) model and batch per device kind. ``cpu`` is sized for
#: a 2-core machine: GPT-2 small's width and depth, batch 4 of 512 tokens; one step saves
#: over 1 GiB of activations (1.17 GiB offloaded; the last layer, LM head and loss stay;
#: ``gds-offload demo`` prints the measured figures) and takes about 6 s without offloading.
#: The width matters on a CPU: moving a byte costs CPU time that compute would otherwise
#: use, and compute per saved byte grows with the width. ``cuda`` is a starting point for one large GPU, not measured by this project
#: yet: override with ``--layers/--hidden/...``.
DEMO_PRESETS: dict[str, tuple[GPTConfig, int]] = {
    "cpu": (GPTConfig(layers=12, hidden=768, heads=12, seq=512, vocab=4096, dropout=0.1), 4),
    "cuda": (GPTConfig(layers=8, hidden=4096, heads=32, seq=1024, vocab=32000, dropout=0.1), 4),
}


#: ``gds-offload demo`` without ``--full``: the same model at half the sequence on a CPU (a
#: step saves about 0.6 GiB, in tensors of 3 MiB and more, and takes 2-3 s), so the whole demo
#: takes about a minute there; on a GPU the model of :data:`DEMO_PRESETS`.
DEMO_QUICK_PRESETS: dict[str, tuple[GPTConfig, int]] = {
    "cpu": (GPTConfig(layers=12, hidden=768, heads=12, seq=256, vocab=4096, dropout=0.1), 4),
    "cuda": DEMO_PRESETS["cuda"],
}


def demo_preset(device: str, *, quick: bool = False) -> tuple[GPTConfig, int]:
    """``(config, batch)`` of the demo model for ``device`` (``cpu`` or ``cuda[:N]``); ``quick``:
    the default demo's (:data:`DEMO_QUICK_PRESETS`), else the full run's and bench's."""
    return (DEMO_QUICK_PRESETS if quick else DEMO_PRESETS)["cuda" if device.startswith("cuda") else "cpu"]


#: Bytes one :class:`Block` saves for backward per token and unit of width (fp32): its input,
#: both LayerNorm outputs, the fused QKV output, the attention output and its reshaped copy,
#: the MLP's 4x-wide pre- and post-GELU, and the dropout masks: 17.5 floats. Measured: the
#: peak activation memory of ``keep`` runs was 1.02 to 1.10 times this estimate (hidden 128
#: to 512, seq 128 to 512, vocab 1k to 8k; 2-core CPU).
BLOCK_BYTES_PER_TOKEN_WIDTH = 70
#: Logits, their log-softmax and its gradient: three floats per token and vocabulary entry.
HEAD_BYTES_PER_TOKEN_VOCAB = 12
#: A training process before its model: the interpreter, torch, its allocator's slack.
PROCESS_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """What one training step of the built-in GPT needs, fp32 with AdamW (see :func:`estimate_memory`).

    Attributes:
        state_bytes: parameters, gradients and AdamW's two moments (16 bytes per parameter),
            plus :data:`PROCESS_BYTES`.
        layer_bytes: activations one block saves for backward.
        layer_input_bytes: one block's input (what ``recompute`` keeps per layer).
        head_bytes: logits, log-softmax and its gradient.
        layers: blocks.
    """

    state_bytes: int
    layer_bytes: int
    layer_input_bytes: int
    head_bytes: int
    layers: int

    @property
    def activation_bytes(self) -> int:
        """Every block's saved activations plus the head's."""
        return self.layers * self.layer_bytes + self.head_bytes

    def keep_bytes(self) -> int:
        """Without offloading: the model state and every activation."""
        return self.state_bytes + self.activation_bytes

    def recompute_bytes(self) -> int:
        """Checkpointing every block: each block's input, one block's activations at a time, the head."""
        return self.state_bytes + self.layers * self.layer_input_bytes + self.layer_bytes + self.head_bytes

    def offload_bytes(self) -> int:
        """Offloading: the last block kept, one block's writes in flight (the write window), the head."""
        return self.state_bytes + 2 * self.layer_bytes + max(64 << 20, 2 * self.layer_bytes) + self.head_bytes


def estimate_memory(config: GPTConfig, batch: int) -> MemoryEstimate:
    """The memory one training process of ``make_gpt(config)`` needs at ``batch`` sequences per step."""
    tokens = batch * config.seq
    return MemoryEstimate(
        state_bytes=16 * config.params() + PROCESS_BYTES,
        layer_bytes=BLOCK_BYTES_PER_TOKEN_WIDTH * tokens * config.hidden,
        layer_input_bytes=4 * tokens * config.hidden,
        head_bytes=HEAD_BYTES_PER_TOKEN_VOCAB * tokens * config.vocab,
        layers=config.layers,
    )
