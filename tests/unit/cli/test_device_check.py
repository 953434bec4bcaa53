"""`device: cuda` without CUDA: one line before anything is created."""

import pytest
import torch

from chunk_grpo.cli.runner import run_command
from chunk_grpo.cli.train import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_and_leaves_nothing(tmp_path, capsys):
    # The command's own entry point in this process (a subprocess spends 10-90 s importing the
    # trainer on the shared CI machine): main() under run_command, as `python -m` runs it.
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(["--run.device", "cuda", "--run.output_dir", str(out)]),
                    "python -m chunk_grpo.train")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "device: cuda is set but CUDA is not available" in lines[0]
    assert "use device: cpu or auto" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
