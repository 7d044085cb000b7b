import pytest
import torch


@pytest.fixture(scope="session")
def qwen2_tied_dir(tmp_path_factory):
    """Tied embeddings, a large rope_theta, MHA (kv heads == heads)."""
    from tests.models.qwen2.checkpoint import save_qwen2_checkpoint

    folder = tmp_path_factory.mktemp("qwen2_tied")
    save_qwen2_checkpoint(folder, seed=1, tie_word_embeddings=True, rope_theta=1e6, num_key_value_heads=4)
    return folder


@pytest.fixture(scope="session")
def qwen2_hf(qwen2_dir):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(qwen2_dir)


@pytest.fixture(scope="session")
def qwen2_pipeline(qwen2_dir):
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, pipeline = load_pipeline(qwen2_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    return pipeline
