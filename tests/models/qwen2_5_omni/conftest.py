import pytest
import torch


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory):
    from tests.models.qwen2_5_omni.checkpoint import save_omni_checkpoint

    folder = tmp_path_factory.mktemp("qwen2_5_omni")
    save_omni_checkpoint(folder, seed=0)
    return folder


@pytest.fixture(scope="session")
def omni_hf(omni_dir):
    """transformers' model as a user loads it (from_pretrained reads spk_dict.pt too), fp32."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(omni_dir)


@pytest.fixture(scope="session")
def omni_pipeline(omni_dir):
    from tests.models.omni_helpers import cpu_pipeline

    return cpu_pipeline(omni_dir)
