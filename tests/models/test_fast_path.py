"""``"auto"`` kernel options (DeployConfig's defaults): the family's exact fast path on CUDA,
the eager reference on a CPU; explicit values win; what a machine cannot run is refused at load."""

from __future__ import annotations

import logging

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models import fast_path
from omniloop.models.fast_path import FastPath, resolve_kernels
from omniloop.models.model_spec import LoadOptions

WAN_LIKE = FastPath(attention_backends=("sdpa_cudnn", "sdpa"), cfg_mode="batched", compile=True)


def test_auto_is_the_default_and_keeps_the_cpu_reference():
    options = load_options(DeployConfig(device="cpu"))
    assert options.auto == {"attention_backend", "cfg_mode", "compile"}
    resolved = resolve_kernels(options, WAN_LIKE, family="wan")
    assert (resolved.attention_backend, resolved.cfg_mode, resolved.compile) == ("sdpa", "sequential", False)
    assert resolved.auto == frozenset()


def test_explicit_values_win_over_the_family_path():
    options = load_options(DeployConfig(device="cpu", cfg_mode="batched", compile=False, attention_backend="math"))
    assert options.auto == frozenset()
    resolved = resolve_kernels(options, WAN_LIKE, family="wan")
    assert (resolved.attention_backend, resolved.cfg_mode, resolved.compile) == ("math", "batched", False)


def test_on_cuda_auto_takes_the_first_backend_the_gpu_runs(monkeypatch, caplog):
    """The CUDA branch, on this CPU machine: the GPU's capabilities are what the checks ask."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(fast_path, "compile_runs", lambda device: True)
    options = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16,
                          auto=frozenset({"attention_backend", "cfg_mode", "compile"}))
    with caplog.at_level(logging.INFO, logger="omniloop.models.fast_path"):
        resolved = resolve_kernels(options, WAN_LIKE, family="wan")
    assert (resolved.attention_backend, resolved.cfg_mode, resolved.compile) == ("sdpa_cudnn", "batched", True)
    assert "attention_backend=sdpa_cudnn, cfg_mode=batched, compile=True" in caplog.text  # one line says what ran
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # Turing: no cuDNN flash
    assert resolve_kernels(options, WAN_LIKE, family="wan").attention_backend == "sdpa"


def test_compile_without_triton_on_cuda_is_refused_when_asked_and_logged_when_auto(monkeypatch, caplog):
    monkeypatch.setattr(fast_path, "compile_runs", lambda device: False)
    explicit = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, compile=True)
    with pytest.raises(ValueError, match=r"compile=True on cuda needs Triton.*--no-compile"):
        resolve_kernels(explicit, WAN_LIKE, family="wan")
    auto = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, auto=frozenset({"compile"}))
    with caplog.at_level(logging.WARNING, logger="omniloop.models.fast_path"):
        assert resolve_kernels(auto, WAN_LIKE, family="wan").compile is False
    assert "Triton is not installed" in caplog.text  # never a silent fallback


def test_parallel_deployments_keep_their_axis_rules():
    """cfg=2 puts the branches on two ranks: an "auto" cfg_mode must not batch them."""
    options = load_options(DeployConfig(device="cpu", parallel="cfg=2"))
    assert options.cfg_mode == "sequential" and "cfg_mode" not in options.auto


def test_a_loaded_wan_pipeline_on_cpu_is_eager_and_sequential(wan_t2v_dir):
    from omniloop.models.loader import load_pipeline

    _, pipeline = load_pipeline(wan_t2v_dir, load_options(DeployConfig(device="cpu", dtype="float32")))
    assert pipeline.compiled is False
    dit = pipeline.components["transformer"]
    assert {m.attention_backend for m in dit.modules() if hasattr(m, "attention_backend")} == {"sdpa"}


def test_limits_max_batch_is_the_old_spelling_of_max_images():
    """limits.max_batch read as the scheduler's batch size (DeployConfig.max_batch); the field is
    max_images now, and a deploy file with the old name keeps working for a round, warned."""
    from omniloop.deploy import Limits

    with pytest.warns(DeprecationWarning, match=r"limits.max_batch is deprecated: it is limits.max_images"):
        limits = DeployConfig(device="cpu", limits={"max_batch": 3}).limits
    assert limits == Limits(max_images=3)
