"""tools/convert_config_access.py: flat config accesses become sectioned ones, nothing else."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "tools" / "convert_config_access.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("convert_config_access", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("old", "new"), [
    ("x = cfg.lr * tr.cfg.group_size\n", "x = cfg.optim.lr * tr.cfg.sampling.group_size\n"),
    ("self.cfg.reward_overlap = False\n", "self.cfg.reward.overlap = False\n"),
    ("f'{base_cfg.model} {cfg.chunks}'\n", "f'{base_cfg.model.name} {cfg.chunks.spec}'\n"),
    ("a = cfg.model.height + cfg.reward.name\n", "a = cfg.model.height + cfg.reward.name\n"),
    ("p(cfg.model.startswith('x'))\n", "p(cfg.model.name.startswith('x'))\n"),
    ("n = cfgs['auto'].chunk_size\n", "n = cfgs['auto'].chunks.size\n"),
    ("n = build_config(None).num_steps\n", "n = build_config(None).sampling.steps\n"),
    ("w = TrainConfig().sde_window\n", "w = TrainConfig().sampling.sde_window\n"),
    ("v = getattr(cfg, 'eval_every')\n", "v = cfg.eval.every\n"),
    ("v = getattr(cfg, key)\n", "v = cfg.get(key)\n"),
    # not a config: other receivers, a longer name, an attribute of something else
    ("policy.height = x.lr + pipe.config.shift + cfg.lrx\n",
     "policy.height = x.lr + pipe.config.shift + cfg.lrx\n"),
    ("import dataclasses\n\ncfg = dataclasses.replace(cfg, max_steps=step, lr=f(cfg.lr))\n",
     "\ncfg = cfg.with_changes({\"run.max_steps\": step, \"optim.lr\": f(cfg.optim.lr)})\n"),
    ("import dataclasses\n\nc = dataclasses.replace(tr.cfg, **changes)\n"
     "d = dataclasses.replace(b, lr=1)\n",  # b: not a config
     "import dataclasses\n\nc = tr.cfg.with_changes(changes)\n"
     "d = dataclasses.replace(b, lr=1)\n"),
    ("c = TrainConfig(model=str(m), progress=False)\n",
     "c = TrainConfig().with_changes({\"model.name\": str(m), \"run.progress\": False})\n"),
    ("cfg = SimpleNamespace(grad_accum=0, eta=ETA, clip_low=0.2)\n",
     "cfg = SimpleNamespace(\n    optim=SimpleNamespace(grad_accum=0), sampling=SimpleNamespace("
     "eta=ETA),\n    loss=SimpleNamespace(clip_low=0.2))\n"),
    ("policy = SimpleNamespace(height=32, width=32)\n",
     "policy = SimpleNamespace(height=32, width=32)\n"),
])
def test_conversions(tool, old, new):
    names = set(tool.FLAT_ALIASES)
    assert tool.convert(old, names) == new
    assert tool.convert(new, names) == new  # running it again changes nothing


def test_long_calls_are_wrapped_and_names_restrict(tool):
    old = ("def f():\n"
           "    cfg = TrainConfig(model=str(model_dir), output_dir=str(tmp_path / 'run'), "
           "progress=False,\n                      image_grid_every=0, prompts_per_step=4)\n")
    new = tool.convert(old, set(tool.FLAT_ALIASES))
    assert all(len(line) <= 100 for line in new.splitlines())
    assert new.startswith('def f():\n    cfg = TrainConfig().with_changes({\n        "model.name"')
    assert tool.convert("cfg.lr + cfg.model\n", {"model"}) == "cfg.lr + cfg.model.name\n"


def test_remove_shim_drops_the_marked_blocks(tool):
    text = ("a = 1\n\n\n    # >>> TRANSITION SHIM: why\n    def f():\n        pass\n"
            "    # <<< TRANSITION SHIM\n\n\nb = 2\n")
    assert tool.remove_shim(text) == "a = 1\n\n\nb = 2\n"
