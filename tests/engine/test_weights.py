"""The weight plane on the tiny Wan checkpoint: update_weights (file, state dict, the engine's
own module), its barrier (finish / requeue), atomic refusals, weight_version, sleep / wake."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.engine import Engine, EngineConfig, QueueFull
from omniloop.engine.weights import WeightUpdateRefused, version_key
from omniloop.models.loader import load_pipeline
from omniloop.request import ErrorKind
from tests.engine.conftest import OPTS, req, run_all

CKPT = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture
def engine(wan_t2v_dir):
    """A pipeline of its own: these tests change its weights."""
    return Engine(load_pipeline(wan_t2v_dir, OPTS)[1], EngineConfig())


def _latents(engine, seed=0, steps=2, **kw):
    r = req(seed=seed, steps=steps, **kw)
    engine.add_request(r)
    out = run_all(engine)[0][r.request_id]
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents, out


def _perturbed_file(wan_t2v_dir, tmp_path, scale=0.05):
    """The model's own transformer file with every float weight nudged (checkpoint names)."""
    sd = load_file(str(wan_t2v_dir / CKPT))
    gen = torch.Generator().manual_seed(7)
    bumped = {k: (v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)) if v.is_floating_point() else v
              for k, v in sd.items()}
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(bumped, str(path))
    return path


def test_swap_from_file_changes_outputs_and_swapping_back_is_bit_equal(engine, wan_t2v_dir, tmp_path):
    params_before = {n: p for n, p in engine.pipeline.components["transformer"].named_parameters()}
    base, out0 = _latents(engine)
    assert out0.weight_version == "0"
    info = engine.update_weights(_perturbed_file(wan_t2v_dir, tmp_path), "1")
    assert (info.version, info.role, info.component) == ("1", "policy", "transformer") and info.copied_tensors > 0
    changed, out1 = _latents(engine)
    assert out1.weight_version == "1"
    assert not torch.equal(changed, base)
    engine.update_weights(wan_t2v_dir / CKPT, "2")  # the checkpoint's own file: the original weights
    back, out2 = _latents(engine)
    assert out2.weight_version == "2" and torch.equal(back, base)
    # in place: the module's parameters are the same objects (LoRA wrappers, a trainer's handle)
    assert all(p is params_before[n] for n, p in engine.pipeline.components["transformer"].named_parameters())


def test_state_dict_and_the_engines_own_module(engine):
    dit = engine.pipeline.components["transformer"]
    base, _ = _latents(engine)
    own = engine.update_weights(dit, "1")  # library mode: the trainer's module is the engine's
    assert own.copied_tensors == 0
    sd = {k: v.detach().clone() * 1.01 for k, v in dit.state_dict().items() if k.endswith("weight") and v.ndim == 2}
    info = engine.update_weights(sd, "2")  # our module's names, a subset (one shard)
    assert info.copied_tensors == len(sd)
    assert not torch.equal(_latents(engine)[0], base)
    cache = engine.pipeline.caches["text_embeddings"]
    assert cache.epoch == 2  # every update starts a new text-embedding epoch


@pytest.mark.parametrize("bad, named", [
    (lambda sd: {**sd, "blocks.0.nonsense.weight": torch.zeros(2)}, "blocks.0.nonsense.weight"),
    (lambda sd: {**sd, "proj_out.weight": torch.zeros(3, 3)}, "proj_out.weight"),
    (lambda sd: {**sd, "proj_out.bias": sd["proj_out.bias"].long()}, "proj_out.bias"),
    (lambda sd: {**sd, "proj_out.bias": sd["proj_out.bias"] * float("nan")}, "proj_out.bias"),
])
def test_a_bad_tensor_is_refused_by_name_and_nothing_changes(engine, wan_t2v_dir, bad, named):
    base, _ = _latents(engine)
    sd = {k: v * 2 for k, v in load_file(str(wan_t2v_dir / CKPT)).items()}  # would change everything
    with pytest.raises(WeightUpdateRefused, match=named.replace(".", r"\.")) as err:
        engine.update_weights(bad(sd), "1")
    assert err.value.field == "source"
    after, out = _latents(engine)
    assert torch.equal(after, base) and out.weight_version == "0"


def test_an_older_version_is_refused(engine):
    dit = engine.pipeline.components["transformer"]
    engine.update_weights(dit, "step-10")
    for stale in ("step-9", "step-10", "0"):
        with pytest.raises(WeightUpdateRefused, match="not newer than the current version 'step-10'") as err:
            engine.update_weights(dit, stale)
        assert err.value.field == "version"
    assert engine.weights.version == "step-10"
    assert version_key("step-9") < version_key("step-10") < version_key("step-10a")


def test_finish_lets_running_requests_end_on_the_old_weights(engine, wan_t2v_dir, tmp_path):
    base, _ = _latents(engine, steps=3)
    path = _perturbed_file(wan_t2v_dir, tmp_path)
    running = req(seed=0, steps=3, rid="running")
    engine.add_request(running)
    with torch.inference_mode():
        engine.step(), engine.step()  # in its loop
    future = engine.weights.schedule_update(path, "1", running="finish")
    waiting = req(seed=0, steps=3, rid="waiting")
    engine.add_request(waiting)
    outs, order = run_all(engine)
    assert future.done() and order == ["running", "waiting"]
    assert outs["running"].weight_version == "0" and torch.equal(outs["running"].artifacts["latents"].latents, base)
    assert outs["waiting"].weight_version == "1"
    assert not torch.equal(outs["waiting"].artifacts["latents"].latents, base)


def test_requeue_restarts_running_requests_on_the_new_weights(engine, wan_t2v_dir, tmp_path):
    path = _perturbed_file(wan_t2v_dir, tmp_path)
    running = req(seed=0, steps=3, rid="running")
    engine.add_request(running)
    with torch.inference_mode():
        engine.step(), engine.step(), engine.step()
    engine.weights.schedule_update(path, "1", running="requeue")
    outs, _ = run_all(engine)
    fresh, _ = _latents(engine, steps=3)  # a request started on the new weights
    assert outs["running"].weight_version == "1"
    assert torch.equal(outs["running"].artifacts["latents"].latents, fresh)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_and_wake_restores_bit_equal(engine, level):
    base, _ = _latents(engine)
    dit, vae = engine.pipeline.components["transformer"], engine.pipeline.components["vae"]
    report = engine.sleep(level)
    assert "transformer" in report.components
    assert all(p.numel() == 0 for p in dit.parameters())
    assert all(p.numel() > 0 for p in vae.parameters()) == (level == 1)  # level 1 keeps the VAE
    r = req(seed=0, steps=2, rid="asleep")
    engine.add_request(r)  # waits while asleep
    with torch.inference_mode():
        for _ in range(3):
            assert engine.step() == []
    assert engine.num_waiting() == 1
    engine.wake()
    outs, _ = run_all(engine)
    assert torch.equal(outs["asleep"].artifacts["latents"].latents, base)


def test_asleep_refuses_when_configured(wan_t2v_dir):
    engine = Engine(load_pipeline(wan_t2v_dir, OPTS)[1], EngineConfig(while_asleep="reject"))
    engine.sleep(1)
    with pytest.raises(QueueFull, match="asleep") as err:
        engine.add_request(req())
    assert err.value.kind is ErrorKind.ASLEEP
    with pytest.raises(WeightUpdateRefused, match="asleep"):
        engine.update_weights(engine.pipeline.components["transformer"], "1")
    engine.wake()
    _latents(engine)


def test_weights_restored_inside_the_engine_thread_stay_trainable(engine):
    """The AsyncEngine thread steps in inference mode: a wake (or an update) there must not turn
    the trainer's parameters into inference tensors."""
    dit = engine.pipeline.components["transformer"]
    with torch.inference_mode():
        engine.sleep(1)
        engine.wake()
    assert not any(p.is_inference() for p in dit.parameters())
    x = next(dit.parameters()).requires_grad_(True)  # a trainer's step on the woken module
    (x * 2).sum().backward()
    assert x.grad is not None
