"""A Wan VACE DiT parallelized from outside (the Wan plan: its control hints split with the
tokens, the control blocks run whole on every rank) equals the one-process DiT on 2 gloo ranks."""

from __future__ import annotations

import torch

from tests.factories import tiny_wan_dit_config
from tests.parallel.ranks import rank_threads, run_ranks, threads

TOL = 2e-6  # tp: float32 reassociation only
GRID = (3, 6, 6)  # 27 tokens: shards of unequal length


def _model():
    from omniloop.models.families.wan.model import WanVaceConfig, WanVaceDiT

    torch.manual_seed(0)
    config = WanVaceConfig(**tiny_wan_dit_config(num_attention_heads=4, num_layers=4), vace_layers=(0, 2),
                           vace_in_channels=96)
    return WanVaceDiT(config).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    f, h, w = GRID
    return (torch.randn(1, 16, f, h, w, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g),
            torch.randn(1, 96, f - 1, h, w, generator=g))  # one control frame fewer: zero-padded tokens


def _run(model):
    x, t, text, control = _inputs()
    return model(x, t, text, control_hidden_states=control, control_scale=torch.tensor([[0.5, 1.5]]))


def _parallel_outputs(rank, world, specs):
    from omniloop.models.families.wan.parallelize import WAN_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.spec import ParallelSpec

    out = {}
    for text in specs:
        model = _model()
        parallelize_model(model, WAN_PARALLEL, ParallelMesh.build(ParallelSpec.from_flag(text), torch.device("cpu")))
        with torch.inference_mode():
            out[text] = _run(model)
    return out


def test_vace_dit_on_two_ranks_equals_one():
    specs = ("ulysses=2", "tp=2")
    results = run_ranks(_parallel_outputs, 2, specs)
    with torch.inference_mode(), threads(rank_threads(2)):
        reference = _run(_model())
    for rank_out in results:
        assert torch.equal(rank_out["ulysses=2"], reference)  # Ulysses: bit-identical
        assert (rank_out["tp=2"] - reference).abs().max().item() <= TOL
