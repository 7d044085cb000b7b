"""The Snake activation and the dilated residual unit of the Oobleck / DAC-style 1-D audio
codecs (Stable Audio's Oobleck VAE, Cosmos3's AVAE sound tokenizer): one definition, so both
load the same parameter names (``snake1.alpha``, ``conv1.weight``...); and transformers'
``SnakeBeta`` of the omni speech decoders (Qwen2.5-Omni's BigVGAN, Qwen3-Omni's code2wav), whose
checkpoints store ``alpha`` / ``beta`` as ``[C]``."""

from __future__ import annotations

import torch
from torch import nn


class Snake1d(nn.Module):
    """x + 1/(beta + 1e-9) * sin(alpha x)^2 on [B, C, T]; alpha and beta per channel, stored as logs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1, channels, 1))  # log alpha
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))  # log beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, beta = torch.exp(self.alpha), torch.exp(self.beta)
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class SnakeBeta(nn.Module):
    """``x + 1/(e^beta + 1e-9) * sin(x e^alpha)^2`` on ``[B, C, T]`` (alpha, beta: logs, per channel ``[C]``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, beta = torch.exp(self.alpha[None, :, None]), torch.exp(self.beta[None, :, None])
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResidualUnit(nn.Module):
    """Snake -> dilated 7-tap conv -> Snake -> 1x1 conv, added to the input (trimmed to the
    output's length when the conv shortens it): [B, dim, T] -> [B, dim, T']."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(dim)
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(dim)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.snake2(self.conv1(self.snake1(x))))
        trim = (x.shape[-1] - y.shape[-1]) // 2
        return (x[..., trim:-trim] if trim > 0 else x) + y
