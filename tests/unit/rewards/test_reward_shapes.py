import dataclasses

import numpy as np
import pytest
import torch
from scipy import ndimage

from chunk_grpo.rewards import (
    ShapesReward,
    available_rewards,
    get_reward,
    register_reward,
    unregister_reward,
)
from chunk_grpo.rewards.registry import UnknownRewardError
from chunk_grpo.shapes import (
    PromptError,
    Scene,
    layout_scene,
    parse_prompt,
    random_scene,
    render_scene,
    scene_to_prompt,
)
from chunk_grpo.shapes.render import draw_objects


def to_tensor(images) -> torch.Tensor:
    array = np.stack(images).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


@pytest.fixture(scope="module")
def reward():
    return get_reward("shapes")


def score(reward, image: np.ndarray, prompt: str) -> float:
    return float(reward(to_tensor([image]), [prompt])[0])


def test_ground_truth_scores_near_one(reward):
    rng = np.random.default_rng(0)
    scenes = [random_scene(rng, split="all") for _ in range(400)]
    images = to_tensor([render_scene(s, rng=rng) for s in scenes])
    scores = reward(images, [scene_to_prompt(s) for s in scenes])
    assert scores.dtype == torch.float32 and scores.shape == (400,)
    assert scores.mean() >= 0.98
    assert torch.equal(scores, reward(images, [scene_to_prompt(s) for s in scenes]))


@pytest.mark.parametrize("size", [32, 96])
def test_other_canvas_sizes(reward, size):
    rng = np.random.default_rng(size)
    scenes = [random_scene(rng, split="all") for _ in range(60)]
    images = to_tensor([render_scene(s, size=size, rng=rng) for s in scenes])
    assert reward(images, [scene_to_prompt(s) for s in scenes]).mean() >= 0.98


def test_blurred_ground_truth_keeps_most_credit(reward):
    rng = np.random.default_rng(1)
    scenes = [random_scene(rng, split="all") for _ in range(100)]
    images = [render_scene(s, rng=rng).astype(np.float32) for s in scenes]
    blurred = [ndimage.gaussian_filter(im, (1.0, 1.0, 0)) for im in images]
    assert reward(to_tensor(blurred), [scene_to_prompt(s) for s in scenes]).mean() >= 0.95


def test_noise_scores_near_zero(reward):
    prompts = [scene_to_prompt(random_scene(np.random.default_rng(i))) for i in range(128)]
    noise = torch.rand(128, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert reward(noise, prompts).mean() <= 0.05
    assert reward(torch.full((128, 3, 64, 64), 0.96), prompts).max() == 0.0  # blank canvas
    # Colour noise smoothed into blobs: ragged clusters are not objects.
    smooth = ndimage.gaussian_filter(noise.numpy(), (0, 0, 1.0, 1.0))
    assert reward(torch.from_numpy(smooth), prompts).mean() <= 0.05


def _other(values, current):
    return next(v for v in values if v != current)


def _with_group(scene: Scene, index: int, **changes) -> Scene:
    groups = list(scene.objects)
    groups[index] = dataclasses.replace(groups[index], **changes)
    return dataclasses.replace(scene, objects=tuple(groups))


FLIP = {
    "left": "right",
    "right": "left",
    "top": "bottom",
    "bottom": "top",
    "left of": "right of",
    "right of": "left of",
    "above": "below",
    "below": "above",
}

SCENES = [
    "two small red circles",
    "a large yellow square",
    "three large cyan triangles",
    "a small purple circle on the left",
    "two large green triangles at the bottom",
    "a large blue square above two small yellow triangles",
    "two small red squares to the left of a large cyan circle",
    "a large purple triangle below a small green circle",
]


@pytest.mark.parametrize("prompt", SCENES)
def test_each_kind_of_error_lowers_the_score(reward, prompt):
    scene = parse_prompt(prompt)
    seed = 3
    truth = score(reward, render_scene(scene, rng=seed), prompt)
    assert truth >= 0.98
    group = scene.objects[0]
    # Same layout (same seed), one attribute of the first group changed.
    wrong = {
        "colour": _with_group(scene, 0, colour=_other(("red", "blue"), group.colour)),
        "shape": _with_group(scene, 0, shape=_other(("circle", "square"), group.shape)),
        "size": _with_group(scene, 0, size=_other(("small", "large"), group.size)),
        "count": _with_group(scene, 0, count=group.count + 1 if group.count < 2 else 1),
    }
    if scene.position is not None:
        wrong["position"] = dataclasses.replace(scene, position=FLIP[scene.position])
    if scene.relation is not None:
        wrong["relation"] = dataclasses.replace(scene, relation=FLIP[scene.relation])
    for kind, bad_scene in wrong.items():
        bad = score(reward, render_scene(bad_scene, rng=seed), prompt)
        assert bad < truth - 0.02, (kind, bad, truth)
    placed = layout_scene(scene, rng=seed)
    missing = score(reward, draw_objects(placed[1:]), prompt)
    assert missing < truth - 0.1
    two_wrong = _with_group(wrong["colour"], 0, shape=wrong["shape"].objects[0].shape)
    assert score(reward, render_scene(two_wrong, rng=seed), prompt) < score(
        reward, render_scene(wrong["colour"], rng=seed), prompt
    )


def test_details_report_the_wrong_attribute(reward):
    prompt = "a large red circle to the left of a small blue square"
    scene = parse_prompt(prompt)
    truth = reward.details(to_tensor([render_scene(scene, rng=0)]), [prompt])
    assert all(float(v[0]) == 1.0 for v in truth.values())
    bad_scene = dataclasses.replace(_with_group(scene, 0, colour="green"), relation="right of")
    bad = reward.details(to_tensor([render_scene(bad_scene, rng=0)]), [prompt])
    assert float(bad["colour_acc"][0]) == 0.5  # one of two objects
    assert float(bad["shape_acc"][0]) == 1.0 and float(bad["size_acc"][0]) == 1.0
    assert float(bad["spatial_acc"][0]) == 0.0 and float(bad["exact"][0]) == 0.0
    plain = reward.details(
        to_tensor([render_scene(parse_prompt("a small red circle"))]), ["a small red circle"]
    )
    assert torch.isnan(plain["spatial_acc"][0])


def test_bad_inputs_raise(reward):
    image = torch.zeros(1, 3, 64, 64)
    with pytest.raises(PromptError, match="vocabulary"):
        reward(image, ["a photo of a cat"])
    with pytest.raises(ValueError, match="prompts"):
        reward(torch.zeros(2, 3, 64, 64), ["a small red circle"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.zeros(1, 64, 64, 3), ["a small red circle"])
    with pytest.raises(ValueError, match="list"):
        reward(image, "a small red circle")


class Constant:
    def __init__(self, value: float = 0.5):
        self.value = value

    def __call__(self, images, prompts):
        return torch.full((len(prompts),), self.value)


def test_registry(register_test_reward):
    assert "shapes" in available_rewards()
    assert isinstance(get_reward("shapes"), ShapesReward)
    with pytest.raises(ValueError, match="available"):
        get_reward("no-such-reward")
    register_test_reward("test-constant", Constant)
    assert get_reward("test-constant", value=0.25)(None, ["x", "y"]).tolist() == [0.25, 0.25]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("shapes")(Constant)


def test_unregister_frees_the_name_and_refuses_an_unknown_one():
    register_reward("test-unregistered")(Constant)
    unregister_reward("test-unregistered")
    assert "test-unregistered" not in available_rewards()
    with pytest.raises(UnknownRewardError, match="unknown reward 'test-unregistered'"):
        get_reward("test-unregistered")
    # the name is free again, for another factory
    register_reward("test-unregistered")(lambda: Constant(0.75))
    assert get_reward("test-unregistered")(None, ["x"]).tolist() == [0.75]
    unregister_reward("test-unregistered")
    with pytest.raises(UnknownRewardError, match="cannot unregister reward 'test-unregistered': "
                                                 "it is not registered"):
        unregister_reward("test-unregistered")
    assert "shapes" in available_rewards()  # the others stay


USER_REWARD_MODULE = """
import torch
from chunk_grpo.rewards import register_reward


@register_reward("test_user_green")
class Greenness:
    def __call__(self, images, prompts):
        return images[:, 1].mean(dim=(1, 2)) - images[:, [0, 2]].mean(dim=(1, 2, 3))
"""


def test_module_colon_name_imports_a_users_reward(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_for_test.py").write_text(USER_REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = get_reward("user_rewards_for_test:test_user_green")
    images = torch.zeros(2, 3, 4, 4)
    images[0, 1] = 1.0  # all green
    assert reward(images, ["x", "y"]).tolist() == [1.0, 0.0]
    assert "test_user_green" in available_rewards()
    with pytest.raises(ValueError, match="cannot import module 'no_such_user_module'"):
        get_reward("no_such_user_module:anything")
    with pytest.raises(ValueError, match="unknown reward 'missing' after importing "
                                         "'user_rewards_for_test'"):
        get_reward("user_rewards_for_test:missing")
    with pytest.raises(ValueError, match="write 'module:name'"):
        get_reward("user_rewards_for_test:")
    # A missing import inside the user's module is their error, reported as such (one line).
    (tmp_path / "user_rewards_broken.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ValueError, match="importing module 'user_rewards_broken' failed at .*"
                                         "No module named 'no_such_dependency_xyz'"):
        get_reward("user_rewards_broken:anything")

