"""load_flux_pipeline: one path for local directories and hub ids, clear errors, no fallback."""

import shutil

import pytest

from chunk_grpo.models import FluxPolicy, ModelLoadError, SamplingDefaults, load_flux_pipeline


@pytest.fixture(scope="module")
def model_dir(tiny_flux):
    return tiny_flux


def test_loads_local_directory_as_path_or_string(model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = load_flux_pipeline(model_dir)
    b = load_flux_pipeline(str(model_dir))
    assert type(a).__name__ == "FluxPipeline" and len(a.tokenizer_2) == len(b.tokenizer_2)


def test_missing_directory_says_what_to_download(tmp_path):
    missing = tmp_path / "FLUX.1-dev"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        FluxPolicy.from_pretrained(missing)
    assert "hf download black-forest-labs/FLUX.1-dev" in str(info.value)
    assert str(missing) in str(info.value)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_flux_pipeline("./no/such/model/dir")


def test_directory_without_pipeline_index(tmp_path):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        load_flux_pipeline(tmp_path)


def test_missing_weights_are_reported(tiny_flux_copy):
    target = tiny_flux_copy
    for f in (target / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="transformer/ \\(no .safetensors weights\\)"):
        load_flux_pipeline(target)
    shutil.rmtree(target / "vae")
    with pytest.raises(ModelLoadError, match="vae/ \\(folder missing\\)"):
        load_flux_pipeline(target)


def test_deleted_tokenizer_file_is_an_error_not_a_stub(tiny_flux_copy, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = tiny_flux_copy
    (target / "tokenizer_2" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer_2 has .* tokens but text_encoder_2"):
        load_flux_pipeline(target)


def test_offline_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set") as info:
        FluxPolicy.from_pretrained("no-such-org/fake-flux")
    assert "hf download" in str(info.value) and "no-such-org/fake-flux" in str(info.value)


def test_sampling_defaults_file(model_dir, tmp_path):
    assert SamplingDefaults.load(tmp_path) == SamplingDefaults()  # FLUX.1-dev defaults
    assert SamplingDefaults.load(model_dir).height == 32
    (tmp_path / "chunk_grpo.json").write_text('{"height": 64, "colour": 1}')
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\]"):
        SamplingDefaults.load(tmp_path)
