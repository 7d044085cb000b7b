"""The Wan DiT parallelized from outside on 2 and 4 gloo ranks equals the one-process DiT.

Measured (fp32, CPU): Ulysses is bit-identical (each rank runs the same kernel on whole
heads); ring attention (log-sum-exp merge of partial softmaxes) and tensor parallelism
(partial sums all-reduced) differ by at most ~6e-7 in outputs of magnitude ~1. An odd
token count (27 tokens over 2 or 4 ranks) exercises shards of unequal length.
"""

from __future__ import annotations

import torch

from tests.factories import tiny_wan_dit_config
from tests.parallel.ranks import rank_threads, run_ranks, threads

TOL = 2e-6  # ring / tp: float32 reassociation only
GRIDS = ((3, 8, 8), (3, 6, 6))  # latent (F, H, W) -> 48 and 27 tokens after the 1x2x2 patch


def _model():
    from omniloop.models.families.wan.model import WanDiT, WanDiTConfig

    torch.manual_seed(0)
    return WanDiT(WanDiTConfig(**tiny_wan_dit_config(num_attention_heads=4, num_layers=2))).eval()


def _inputs(grid):
    g = torch.Generator().manual_seed(1)
    f, h, w = grid
    return torch.randn(1, 16, f, h, w, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g)


def _parallel_outputs(rank, world, specs):
    from omniloop.models.families.wan.parallelize import WAN_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.spec import ParallelSpec

    out = {}
    for text in specs:
        model = _model()
        mesh = ParallelMesh.build(ParallelSpec.from_flag(text), torch.device("cpu"))
        parallelize_model(model, WAN_PARALLEL, mesh)
        with torch.inference_mode():
            out[text] = [model(*_inputs(grid)) for grid in GRIDS]
    return out


def _check(results, specs):
    model = _model()
    with torch.inference_mode(), threads(rank_threads(len(results))):
        reference = [model(*_inputs(grid)) for grid in GRIDS]
    errors = {}
    for text in specs:
        for rank_out in results:
            for got, ref in zip(rank_out[text], reference):
                assert got.shape == ref.shape
                errors[text] = max(errors.get(text, 0.0), (got - ref).abs().max().item())
                if "ring" not in text and "tp" not in text:
                    assert torch.equal(got, ref), f"{text}: Ulysses should be bit-identical"
    assert all(e <= TOL for e in errors.values()), errors
    return errors


def test_two_ranks_ulysses_ring_tp_equal_one():
    specs = ("ulysses=2", "ring=2", "tp=2")
    errors = _check(run_ranks(_parallel_outputs, 2, specs), specs)
    assert errors["ulysses=2"] == 0.0 and errors["ring=2"] > 0  # the ring really merged partials


def test_four_ranks_usp_and_tp_with_ulysses_equal_one():
    specs = ("ulysses=2,ring=2", "ring=4", "ulysses=2,tp=2")
    _check(run_ranks(_parallel_outputs, 4, specs), specs)


def _per_frame_outputs(rank, world, specs):
    """Wan2.2 TI2V timesteps per latent frame ([1, F']): the blocks' [B, F', 6, D] modulation
    reaches each rank's shard of tokens, whose windows start mid-frame (27 tokens, 9 a frame)."""
    from omniloop.models.families.wan.parallelize import WAN_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.spec import ParallelSpec

    out = {}
    for text in specs:
        model = _model()
        parallelize_model(model, WAN_PARALLEL, ParallelMesh.build(ParallelSpec.from_flag(text), torch.device("cpu")))
        x, _, context = _inputs(GRIDS[1])
        with torch.inference_mode():
            out[text] = model(x, torch.tensor([[0.0, 700.0, 700.0]]), context)
    return out


def test_per_frame_timesteps_shard_with_their_tokens():
    specs = ("ulysses=2", "ring=2")
    results = run_ranks(_per_frame_outputs, 2, specs)
    model = _model()
    x, _, context = _inputs(GRIDS[1])
    with torch.inference_mode(), threads(rank_threads(2)):
        per_token = model(x, torch.tensor([[0.0] * 9 + [700.0] * 18]), context)  # diffusers' layout
        assert torch.equal(model(x, torch.tensor([[0.0, 700.0, 700.0]]), context), per_token)
    for rank_out in results:
        assert torch.equal(rank_out["ulysses=2"], per_token)
        assert (rank_out["ring=2"] - per_token).abs().max().item() <= TOL
