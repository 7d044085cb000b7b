import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))


@pytest.fixture(autouse=True)
def _inductor_cache_dir_restored():
    """A compiled load points Inductor's cache at its compile cache through the environment
    (``compile_cache.use_inductor_dir``, process-wide); a test that compiles in-process must not
    hand that folder to a later test's server subprocess, which would keep it as the user's."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def wan_t2v_dir(tmp_path_factory):
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_t2v")
    save_wan_checkpoint(folder, "t2v")
    return folder


@pytest.fixture(scope="session")
def wan_a14b_dir(tmp_path_factory):
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_a14b")
    save_wan_checkpoint(folder, "t2v_a14b")
    return folder


@pytest.fixture(scope="session")
def wan_i2v_dir(tmp_path_factory):
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_i2v")
    save_wan_checkpoint(folder, "i2v")
    return folder


@pytest.fixture(scope="session")
def wan_vace_dir(tmp_path_factory):
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_vace")
    save_wan_checkpoint(folder, "vace")
    return folder


@pytest.fixture(scope="session")
def wan_animate_dir(tmp_path_factory):
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_animate")
    save_wan_checkpoint(folder, "animate")
    return folder


@pytest.fixture(scope="session")
def far_dir(tmp_path_factory):
    from tests.models.far.checkpoint import save_far_checkpoint

    return save_far_checkpoint(tmp_path_factory.mktemp("far"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from tests.models.qwen2.checkpoint import save_qwen2_checkpoint

    folder = tmp_path_factory.mktemp("qwen2")
    save_qwen2_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def stable_audio_dir(tmp_path_factory):
    from tests.models.stable_audio.checkpoint import save_stable_audio_checkpoint

    folder = tmp_path_factory.mktemp("stable_audio")
    save_stable_audio_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def ltx2_dir(tmp_path_factory):
    from tests.models.ltx2.checkpoint import save_ltx2_checkpoint

    folder = tmp_path_factory.mktemp("ltx2")
    save_ltx2_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    """A tiny FLUX.1-dev-layout checkpoint (tests/flux_checkpoint.py)."""
    from tests.flux_checkpoint import save_flux_checkpoint

    folder = tmp_path_factory.mktemp("flux")
    save_flux_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def flux_redux_dir(tmp_path_factory, flux_dir):
    """flux_dir with FLUX.1-Redux-dev's components beside its own (tests/flux_redux_checkpoint.py)."""
    import shutil

    from tests.flux_redux_checkpoint import add_redux

    folder = tmp_path_factory.mktemp("flux_redux") / "flux"
    shutil.copytree(flux_dir, folder)
    add_redux(folder)
    return folder


@pytest.fixture(scope="session")
def flux_kontext_dir(tmp_path_factory):
    """A tiny FLUX.1-Kontext-dev checkpoint (FluxKontextPipeline's model_index.json)."""
    from tests.flux_checkpoint import save_flux_kontext_checkpoint

    folder = tmp_path_factory.mktemp("flux_kontext")
    save_flux_kontext_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def flux_fill_dir(tmp_path_factory):
    """A tiny FLUX.1-Fill-dev-layout checkpoint (tests/flux_checkpoint.py)."""
    from tests.flux_checkpoint import save_flux_fill_checkpoint

    folder = tmp_path_factory.mktemp("flux_fill")
    save_flux_fill_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def flux_control_dir(tmp_path_factory):
    """A tiny FLUX.1-Canny/Depth-dev-layout checkpoint (tests/flux_checkpoint.py)."""
    from tests.flux_checkpoint import save_flux_control_checkpoint

    folder = tmp_path_factory.mktemp("flux_control")
    save_flux_control_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def wan_i2v_clip_dir(tmp_path_factory):
    """Wan2.1 I2V: latent concat + CLIP vision tokens (image_encoder / image_processor)."""
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_i2v_clip")
    save_wan_checkpoint(folder, "i2v_clip")
    return folder


@pytest.fixture(scope="session")
def wan_flf2v_dir(tmp_path_factory):
    """Wan2.1 FLF2V: CLIP tokens of the first and last frames (pos_embed_seq_len)."""
    from tests.wan_checkpoint import save_wan_checkpoint

    folder = tmp_path_factory.mktemp("wan_flf2v")
    save_wan_checkpoint(folder, "flf2v")
    return folder


@pytest.fixture(scope="session")
def klein_dir(tmp_path_factory):
    """A tiny FLUX.2-klein folder (step-distilled: no CFG; tests/models/flux2/checkpoint.py)."""
    from tests.models.flux2.checkpoint import save_klein_checkpoint

    folder = tmp_path_factory.mktemp("klein")
    save_klein_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def klein_base_dir(tmp_path_factory, klein_dir):
    """The same weights as a klein base folder (``is_distilled: false``: CFG against ""): the
    klein folder copied with its model_index.json's flag flipped, as the two repos differ."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("klein_base") / "klein_base"
    shutil.copytree(klein_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}, indent=2))
    return folder


@pytest.fixture(scope="session")
def klein_kv_dir(tmp_path_factory):
    """A tiny FLUX.2-klein KV folder (Flux2KleinKVPipeline; klein_dir's weights)."""
    from tests.models.flux2.checkpoint import save_klein_kv_checkpoint

    folder = tmp_path_factory.mktemp("klein_kv")
    save_klein_kv_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def flux2_dev_dir(tmp_path_factory):
    """A tiny FLUX.2-dev folder (Flux2Pipeline: Mistral3 text encoder, guidance-embedding DiT;
    tests/models/flux2/checkpoint.py)."""
    from tests.models.flux2.checkpoint import save_dev_checkpoint

    folder = tmp_path_factory.mktemp("flux2_dev")
    save_dev_checkpoint(folder)
    return folder
