"""The MLP score head that the LAION aesthetic predictor and ImageReward share: Linear layers
in -> 1024 -> 128 -> 64 -> 16 -> 1 with no activations, dropouts 0.2, 0.2, 0.1 after the first
three (inactive at scoring). Its `layers.{0,2,4,6,7}` keys are both checkpoints' own."""

from __future__ import annotations

import torch
from torch import nn

HIDDEN_SIZES = (1024, 128, 64, 16)
DROPOUTS = (0.2, 0.2, 0.1)


class ScoreMLP(nn.Module):
    """The published head; `input_size` is the width of the features it scores (768 for the
    CLIP ViT-L/14 projection and for BERT-base)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        sizes = (input_size, *HIDDEN_SIZES)
        layers: list[nn.Module] = []
        for i in range(len(HIDDEN_SIZES)):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(DROPOUTS):
                layers.append(nn.Dropout(DROPOUTS[i]))
        layers.append(nn.Linear(HIDDEN_SIZES[-1], 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)
