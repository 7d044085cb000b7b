import pytest
import torch


@pytest.fixture(scope="session")
def omni3_dir(tmp_path_factory):
    from tests.models.qwen3_omni.checkpoint import save_omni3_checkpoint

    folder = tmp_path_factory.mktemp("qwen3_omni")
    save_omni3_checkpoint(folder, seed=0)
    return folder


@pytest.fixture(scope="session")
def omni3_hf(omni3_dir):
    """transformers' model as a user loads it, fp32."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni3_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(omni3_dir)


@pytest.fixture(scope="session")
def omni3_pipeline(omni3_dir):
    from tests.models.omni_helpers import cpu_pipeline

    return cpu_pipeline(omni3_dir)
