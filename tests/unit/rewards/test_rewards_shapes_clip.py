"""`shapes-clip`: the `clip` reward on the shipped shapes-world CLIP."""

import numpy as np
import torch

from chunk_grpo.pretrain.clip_eval import clip_scores, heldout_batch, load_clip
from chunk_grpo.rewards import SHAPES_CLIP_DIR, get_reward


def test_shapes_clip_is_the_clip_reward_on_the_shipped_checkpoint_and_prefers_true_captions():
    batch = heldout_batch(64, negatives=1)
    images = torch.from_numpy(batch.images).permute(0, 3, 1, 2).float() / 255
    reward = get_reward("shapes-clip")
    true = reward(images, batch.captions)
    false = reward(images, [n[0] for n in batch.negatives])
    # The same scores as the generic CLIPImageProcessor path (8-bit rounding aside).
    reference = clip_scores(load_clip(SHAPES_CLIP_DIR), batch.images, batch.captions)
    torch.testing.assert_close(true, reference.float(), atol=0.05, rtol=0.01)
    # A caption with one attribute changed scores lower for most images (measured 0.7+).
    assert float((true > false).float().mean()) > 0.6
    assert true.dtype == torch.float32 and np.isfinite(true.numpy()).all()
