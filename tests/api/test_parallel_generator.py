"""One switch for users: ``parallel=...`` on ``VideoGenerator`` / ``AsyncEngine`` starts a
pool of gloo processes on the CPU, and the video equals the single-process one.

Measured on the tiny Wan (fp32): sp (Ulysses) and cfg give bit-identical latents and frames;
ring and tp latents differ by < 1e-5 (float32 reassociation) and the frames by at most one
8-bit level; dp (two requests of one batched step on two ranks) matches the one-process
batched run within 1e-5.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine import AsyncEngine
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, threads

PARAMS = dict(steps=3, height=32, width=32, num_frames=5, seed=3, guidance_scale=4.0)


def _request(rid="clip", seed=3):
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text=f"a red circle {seed}")],
                       outputs=OutputSpec(return_latents=True), diffusion=DiffusionParams(**{**PARAMS, "seed": seed}))


@pytest.fixture(scope="module")
def reference(wan_t2v_dir):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu")
    with torch.inference_mode(), threads(rank_threads(2)):  # as many threads as each of the 2 ranks
        out = gen.generate(_request())
    return out.video.frames.numpy(), out.artifacts["latents"].latents, gen


@pytest.mark.parametrize("spec, exact", [("sp=2", True), ("cfg=2", True), ("ring=2", False), ("tp=2", False)])
def test_generator_output_equals_one_process(wan_t2v_dir, reference, spec, exact):
    frames, latents, _ = reference
    with VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", parallel=spec) as gen:
        assert gen.engine.pool.spec.world == 2
        video = gen.generate_video("a red circle 3", save_video=False, **PARAMS)
        out = gen.generate(_request())
        text_cache = gen.pipeline.caches["text_embeddings"]  # the deployment's caches survive parallelizing
        assert text_cache.stats.hits > 0  # the second request's prompt was the first one's
    got = out.artifacts["latents"].latents
    assert video.frames.shape == frames.shape
    if exact:
        assert torch.equal(got, latents) and np.array_equal(video.frames, frames)
    else:
        assert (got - latents).abs().max().item() < 1e-5
        assert np.abs(video.frames.astype(int) - frames.astype(int)).max() <= 1
    assert not torch.distributed.is_initialized()  # close() stopped the ranks and left the group


def test_dp_splits_a_batched_step_across_ranks(wan_t2v_dir, reference):
    _, _, one = reference
    requests = [_request(f"r{i}", seed=i) for i in range(2)]
    with torch.inference_mode(), threads(rank_threads(2)):
        for r in requests:
            one.engine.add_request(r)
        while one.engine.has_unfinished():
            one.engine.step()
        expected = {r.request_id: one.engine.pop_output(r.request_id).artifacts["latents"].latents for r in requests}
    with VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", parallel="dp=2") as gen:
        engine = gen.engine
        with torch.inference_mode():
            for r in requests:
                engine.add_request(r)
            while engine.has_unfinished():
                engine.step()
        assert engine.stats.batched_steps > 0
        for r in requests:
            got = engine.pop_output(r.request_id).artifacts["latents"].latents
            assert (got - expected[r.request_id]).abs().max().item() < 1e-5


def test_async_engine_starts_the_same_pool(wan_t2v_dir, reference):
    _, latents, _ = reference

    async def go():
        engine = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", parallel="cfg=2")
        try:
            return await engine.generate(_request())
        finally:
            engine.shutdown()

    out = asyncio.run(go())
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert not torch.distributed.is_initialized()


def test_cli_generate_with_parallel_writes_the_one_process_video(wan_t2v_dir, tmp_path, capsys):
    """``omniloop generate --parallel sp=2`` (in this process: rank 0 here, rank 1 forked) writes
    the same mp4 bytes as the one-process command at the ranks' thread count, and leaves no
    pool behind (the command closes it)."""
    from omniloop.api.cli import main

    flags = ["--model", str(wan_t2v_dir), "--steps", "3", "--height", "32", "--width", "32", "--num-frames", "5",
             "--seed", "3", "--guidance-scale", "4.0", "--device", "cpu", "--no-progress",
             "--cpu-threads", str(rank_threads(2))]
    with threads(torch.get_num_threads()):  # the command sets this process's threads: restore them
        assert main(["generate", "a red circle", *flags, "--output", str(tmp_path / "one.mp4")]) == 0
        assert main(["generate", "a red circle", *flags, "--parallel", "sp=2", "--output", str(tmp_path / "sp.mp4")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()
    assert (tmp_path / "sp.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()


class _OneProcessTiles:
    """One process's tiled decode with the pool's tiles (the VAE's own tile loop, no ranks)."""

    def __init__(self, vae, tiling):
        self._vae, self.tiling = vae, tiling

    def decode(self, z, tiling=None, *, whole=False):
        return self._vae.decode(z, tiling or self.tiling, whole=whole)

    def __getattr__(self, name):
        return getattr(self._vae, name)


def test_vae_tiles_through_the_pool_equal_one_process_tiled_decode(wan_t2v_dir, reference):
    """``ulysses=2,vae=tiles``: the denoise is bitwise (Ulysses), and the tiles of the decode
    (16-pixel tiles at stride 8 over 32x32 pixels) are split across the 2 ranks, each decoded by
    one and broadcast (tile counts per rank: tests/parallel/test_vae_tiles.py): the frames equal
    one process decoding the same tiles."""
    from omniloop.engine import Engine, EngineConfig
    from omniloop.models.families.wan.parallelize import WAN_PARALLEL
    from omniloop.pipeline.pipeline import Pipeline

    frames, latents, one = reference
    p = one.pipeline
    tiled = Pipeline(spec=p.spec, components={**p.components, "vae": _OneProcessTiles(p.components["vae"],
                     WAN_PARALLEL.vae.tiling(16, 8))}, device=p.device, dtype=p.dtype, defaults=p.defaults,
                     validate_request=p.validate_request)
    engine = Engine(tiled, EngineConfig())
    with torch.inference_mode(), threads(rank_threads(2)):
        engine.add_request(_request("tiled"))
        expected = engine.run_until_done("tiled").video.frames.numpy()
    assert not np.array_equal(expected, frames)  # the seams of a tiled decode differ from a whole one
    with VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", parallel="ulysses=2,vae=tiles,vae_tile=16,vae_stride=8") as gen:
        out = gen.generate(_request())
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.video.frames.numpy(), expected)
