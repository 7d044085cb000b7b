import pytest
import torch


@pytest.fixture(scope="session")
def cosmos3_dir(tmp_path_factory):
    """A tiny random diffusers Cosmos3OmniPipeline folder (sound and action towers)."""
    from tests.models.cosmos3.checkpoint import save_pipeline

    folder = tmp_path_factory.mktemp("cosmos3")
    save_pipeline(folder)
    return folder


@pytest.fixture(scope="session")
def cosmos3_ref(cosmos3_dir):
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.from_pretrained(cosmos3_dir, enable_safety_checker=False)


@pytest.fixture(scope="session")
def cosmos3_pipeline(cosmos3_dir):
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, pipeline = load_pipeline(cosmos3_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    return pipeline
