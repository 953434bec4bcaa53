import numpy as np
import pytest

from chunk_grpo.shapes import (
    BACKGROUND,
    HELDOUT_PAIRS,
    HELDOUT_PROMPTS_FILE,
    PALETTE,
    RL_PROMPTS_FILE,
    TRAIN_PROMPTS_FILE,
    VOCABULARY,
    PromptError,
    Scene,
    ShapeObject,
    layout_scene,
    load_prompts,
    parse_prompt,
    random_scene,
    render_scene,
    scene_to_prompt,
)
from chunk_grpo.shapes.prompt_sets import distinct_prompts


def test_prompt_round_trip_and_vocabulary():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        scene = random_scene(rng, split="all")
        prompt = scene_to_prompt(scene)
        assert parse_prompt(prompt) == scene
        assert set(prompt.split()) <= set(VOCABULARY)
    assert parse_prompt("  Two SMALL red   circles ") == Scene(
        (ShapeObject("circle", "red", "small", 2),)
    )


def test_parse_examples():
    scene = parse_prompt("two small yellow triangles above a large purple circle")
    assert scene.relation == "above"
    assert scene.objects == (
        ShapeObject("triangle", "yellow", "small", 2),
        ShapeObject("circle", "purple", "large", 1),
    )
    assert parse_prompt("a large blue square on the left").position == "left"
    assert parse_prompt("a small red circle to the right of a small red square").relation == (
        "right of"
    )


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "a red circle",  # no size
        "a small red circles",  # plural after "a"
        "two small red circle",  # singular after "two"
        "a small pink circle",  # unknown colour
        "five small red circles",  # unknown count
        "a small red circle, please",
        "three small red circles on the left",  # too many for a half
        "three small red circles above two small blue squares",  # five objects
        "a small red circle above a large red circle",  # groups indistinguishable
        "a small red circle on the left above a small blue square",
        "small red circle a",
    ],
)
def test_bad_prompts_raise(prompt):
    with pytest.raises(PromptError):
        parse_prompt(prompt)
    assert issubclass(PromptError, ValueError)


def test_splits_respect_heldout_pairs():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        assert not random_scene(rng, split="train").is_heldout
        assert random_scene(rng, split="heldout").is_heldout
    with pytest.raises(ValueError, match="split"):
        random_scene(rng, split="test")


def test_shipped_prompt_files():
    train = load_prompts(TRAIN_PROMPTS_FILE)
    heldout = load_prompts(HELDOUT_PROMPTS_FILE)
    assert len(set(train)) == len(train) >= 1000
    assert len(set(heldout)) == len(heldout) >= 256
    for prompt in train:
        scene = parse_prompt(prompt)
        assert not any((g.colour, g.shape) in HELDOUT_PAIRS for g in scene.objects)
    assert all(parse_prompt(p).is_heldout for p in heldout)


def test_rl_prompts_cover_the_grammar_but_no_evaluation_prompt():
    rl = load_prompts(RL_PROMPTS_FILE)
    assert len(set(rl)) == len(rl) == 2000
    assert not set(rl) & set(load_prompts(HELDOUT_PROMPTS_FILE))
    with_heldout_pair = sum(parse_prompt(p).is_heldout for p in rl)
    assert 0.15 * len(rl) < with_heldout_pair < 0.5 * len(rl)


def test_prompt_sets_regenerate_the_shipped_files():
    heldout = distinct_prompts(256, split="heldout", seed=1)
    assert heldout == load_prompts(HELDOUT_PROMPTS_FILE)
    rl = distinct_prompts(2000, split="all", seed=2, exclude=frozenset(heldout))
    assert rl == load_prompts(RL_PROMPTS_FILE)


def test_render_is_deterministic_and_uses_the_palette():
    scene = parse_prompt("two large green circles to the left of a small red square")
    a = render_scene(scene, rng=5)
    assert a.dtype == np.uint8 and a.shape == (64, 64, 3)
    assert np.array_equal(a, render_scene(scene, rng=np.random.default_rng(5)))
    assert not np.array_equal(a, render_scene(scene, rng=6))
    colours = {tuple(c) for c in a.reshape(-1, 3)}
    assert colours == {BACKGROUND, PALETTE["green"], PALETTE["red"]}
    green = np.all(a == PALETTE["green"], axis=-1)
    red = np.all(a == PALETTE["red"], axis=-1)
    assert np.nonzero(green)[1].max() < np.nonzero(red)[1].min()  # every green left of red


def test_layout_realises_positions_and_relations():
    rng = np.random.default_rng(2)
    for _ in range(500):
        scene = random_scene(rng, split="all")
        placed = layout_scene(scene, rng=rng)
        assert len(placed) == scene.num_objects
        for i, obj in enumerate(placed):
            assert 0 <= obj.x0 and obj.x0 + obj.extent <= 64
            assert 0 <= obj.y0 and obj.y0 + obj.extent <= 64
            for other in placed[:i]:  # at least 4 background pixels between boxes
                gap_x = max(other.x0 - obj.x0 - obj.extent, obj.x0 - other.x0 - other.extent)
                gap_y = max(other.y0 - obj.y0 - obj.extent, obj.y0 - other.y0 - other.extent)
                assert max(gap_x, gap_y) >= 4, scene
        if scene.position is not None:
            cx = [o.centre[0] for o in placed]
            cy = [o.centre[1] for o in placed]
            ok = {
                "left": max(cx) < 32,
                "right": min(cx) > 32,
                "top": max(cy) < 32,
                "bottom": min(cy) > 32,
            }[scene.position]
            assert ok, scene
        if scene.relation is not None:
            n_a = scene.objects[0].count
            a, b = placed[:n_a], placed[n_a:]
            axis = 0 if scene.relation in ("left of", "right of") else 1
            sign = 1 if scene.relation in ("left of", "above") else -1
            for oa in a:
                for ob in b:
                    assert sign * (ob.centre[axis] - oa.centre[axis]) > 8, scene


def test_render_sizes_and_bad_rng():
    scene = parse_prompt("a large cyan triangle")
    assert render_scene(scene, size=96, rng=0).shape == (96, 96, 3)
    with pytest.raises(ValueError, match="rng"):
        render_scene(scene, rng="seed")
    with pytest.raises(ValueError, match="size"):
        render_scene(scene, size=16)
