"""Toy-size shapes recipes on the CPU: one MiniLM and one finished toy chain per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.train.recipes.latent_store import build_latent_store
from omniloop.train.recipes.shapes_distill import DistillRecipe, build_trajectories, train_student
from omniloop.train.recipes.shapes_dit import DiTRecipe, load_trained_dit, train_dit
from omniloop.train.recipes.shapes_vae import MODEL_DIR, VAERecipe, load_trained_vae, train_vae

CPU = torch.device("cpu")


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Toy models are far too small for intra-op threads: on a shared 2-core runner, 2 OpenMP
    threads made the toy chain ~10x slower than 1. Restored after this package."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def minilm(one_thread):
    return load_minilm_encoder(device=CPU, max_sequence_length=32)


def vae_file(work: Path) -> Path:
    return work / "vae" / MODEL_DIR / "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="package")
def toy_chain(tmp_path_factory, minilm) -> Path:
    """Every stage of the toy recipe, finished, in one work dir (prerequisites of later tests)."""
    work = tmp_path_factory.mktemp("toy_chain")
    dit, distill = DiTRecipe.toy(), DistillRecipe.toy()
    assert train_vae(VAERecipe.toy(), work, device=CPU).done
    vae = load_trained_vae(work, CPU)
    assert build_latent_store(dit.store, work, vae=vae, vae_file=vae_file(work), text_encoder=minilm, device=CPU).done
    assert train_dit(dit, work, vae=vae, text_encoder=minilm, device=CPU).done
    teacher = load_trained_dit(work, "dit", CPU)
    assert build_trajectories(distill, work, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU).done
    assert train_student(distill, work, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU).done
    return work


def copy_stages(src: Path, dst: Path, *stages: str) -> Path:
    for stage in stages:
        shutil.copytree(src / stage, dst / stage)
    return dst


class LoopSpy:
    """Records every DenoiseLoop step (which sampler, which sigmas, which CFG branches)."""

    def __init__(self, monkeypatch) -> None:
        self.steps: list[dict] = []
        original = DenoiseLoop.step_many

        def step_many(loop_self, ctx, loops):
            for lp in loops:
                sstate = next(iter(lp.samplers.values()))
                cfg = lp.policy_states[loop_self.cfg.name]
                self.steps.append({"sampler": lp.sampler.name, "sigmas": sstate.sigmas.clone(),
                                   "branches": cfg.branches, "trajectory": lp.trajectory is not None,
                                   "request": lp.request_id})
            return original(loop_self, ctx, loops)

        monkeypatch.setattr(DenoiseLoop, "step_many", step_many)
