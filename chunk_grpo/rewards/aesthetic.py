"""The `aesthetic` reward: the LAION improved aesthetic predictor (C. Schuhmann), the one DDPO and
Flow-GRPO train on.

An MLP head on the L2-normalised CLIP ViT-L/14 image embedding (openai/clip-vit-large-patch14,
768-d), predicting a 1-10 rating:

    Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
    Dropout(0.1), Linear(64, 16), Linear(16, 1)        (no activations, as published)

Weights: sac+logos+ava1-l14-linearMSE.pth from github.com/christophschuhmann/
improved-aesthetic-predictor, a torch state dict with keys layers.{0,2,4,6,7}.{weight,bias}
(the Linear layers' places in the Sequential). Images are preprocessed by the CLIP model's own
image processor (224, bicubic, centre crop, OpenAI mean/std). Prompts are ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from chunk_grpo.rewards.clip_common import load_clip_encoder
from chunk_grpo.rewards.model_files import first_line, resolve_model_dir, reward_inputs
from chunk_grpo.rewards.registry import RewardLoadError, register_reward
from chunk_grpo.rewards.score_mlp import ScoreMLP

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "sac+logos+ava1-l14-linearMSE.pth"


AestheticHead = ScoreMLP  # The LAION aesthetic head: the shared published MLP (`score_mlp`)


def load_aesthetic_head(path: Path, input_size: int) -> AestheticHead:
    """The head saved at `path`, checked key by key and shape by shape."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch errors all mean "not this file"
        raise RewardLoadError(f"reward 'aesthetic': cannot read the head {path}: "
                              f"{first_line(err)}") from None
    head = AestheticHead(input_size)
    if not isinstance(state, dict):
        raise RewardLoadError(f"reward 'aesthetic': {path} is not a state dict")
    expected = head.state_dict()
    if set(state) != set(expected) or any(
        tuple(state[k].shape) != tuple(v.shape) for k, v in expected.items()
    ):
        shapes = {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}
        raise RewardLoadError(f"reward 'aesthetic': {path} is not the improved aesthetic "
                              f"predictor head for {input_size}-d CLIP embeddings (keys and "
                              f"shapes {shapes})")
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval().requires_grad_(False)


@register_reward("aesthetic")
class AestheticScore:
    """LAION aesthetic score (see the module docstring).

    model: the CLIP ViT-L/14 CLIPModel directory (or hub id in the local cache).
    head: the head's .pth file; default: sac+logos+ava1-l14-linearMSE.pth inside `model`.
    """

    def __init__(self, model: str | os.PathLike = AESTHETIC_CLIP,
                 head: str | os.PathLike | None = None, *,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 batch_size: int = 16):
        head_path = Path(resolve_model_dir(model, "aesthetic")) / AESTHETIC_HEAD
        if head is not None:
            head_path = Path(head).expanduser()
        if not head_path.is_file():
            raise RewardLoadError(f"reward 'aesthetic': head file {head_path} does not exist; "
                                  f"download {AESTHETIC_HEAD} from github.com/christophschuhmann/"
                                  f"improved-aesthetic-predictor and put it in the CLIP model's "
                                  f"directory or pass head=PATH")
        self.encoder = load_clip_encoder(model, reward="aesthetic", device=device, dtype=dtype,
                                         batch_size=batch_size)
        # The score never reads the prompt: drop the text tower (ViT-L/14's is 123M parameters).
        del self.encoder.model.text_model, self.encoder.model.text_projection
        projection = self.encoder.model.config.projection_dim
        self.head = load_aesthetic_head(head_path, projection).to(self.encoder.device)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, _ = reward_inputs(images, prompts)
        embeddings = self.encoder.encode_images(images).to(self.encoder.device)
        return self.head(embeddings).squeeze(-1).float().cpu()
