"""Batched sampler updates: requests at the same step of the same schedule take one
``step_many`` whose rows equal each request's own ``step``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from omniloop.pipeline.samplers import build_sampler

CONFIGS = [
    ("flow_euler", {"shift": 3.0}),
    ("flow_unipc", {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
                    "solver_order": 2}),
    ("flow_unipc", {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 5.0,
                    "solver_order": 3, "solver_type": "bh1", "final_sigmas_type": "sigma_min"}),
    ("comfy_uni_pc", {"shift": 3.0}),  # ComfyUI's UniPC: history and pending corrector per request
    ("comfy_uni_pc_bh2", {"shift": 5.0}),
]


@pytest.mark.parametrize(("name", "config"), CONFIGS)
def test_step_many_rows_equal_each_requests_own_steps(name, config):
    sampler = build_sampler(name, config)
    n, steps, shape = 5, 7, (1, 4, 2, 3, 3)
    g = torch.Generator().manual_seed(0)
    x0 = [torch.randn(shape, generator=g) for _ in range(n)]
    outputs = [[torch.randn(shape, generator=g) for _ in range(n)] for _ in range(steps)]
    alone = [sampler.init_state(steps) for _ in range(n)]
    joint = [sampler.init_state(steps) for _ in range(n)]
    xa, xj = list(x0), torch.cat(x0)
    for k in range(steps):
        assert len({sampler.batch_key(s) for s in joint}) == 1  # the same step of the same schedule
        xa = [sampler.step(s, v, x) for s, v, x in zip(alone, outputs[k], xa)]
        xj = sampler.step_many(joint, torch.cat(outputs[k]), xj)
        assert torch.equal(xj, torch.cat(xa)), f"step {k}"
    assert all(s.done for s in joint) and [s.step_index for s in joint] == [s.step_index for s in alone]


def test_requests_at_other_steps_or_schedules_do_not_share_a_key():
    sampler = build_sampler(*CONFIGS[1])
    a, b, c = sampler.init_state(6), sampler.init_state(6), sampler.init_state(6, shift=1.5)
    assert sampler.batch_key(a) == sampler.batch_key(b) != sampler.batch_key(c)
    sampler.step(a, torch.zeros(1, 2), torch.ones(1, 2))
    assert sampler.batch_key(a) != sampler.batch_key(b)


def test_finished_latents_do_not_hold_the_batch_alive():
    from omniloop.pipeline.loops.denoise import _own

    joint = torch.randn(8, 4, 2, 3, 3)
    row = joint[2:3]
    owned = _own(row)
    assert torch.equal(owned, row) and owned.untyped_storage().nbytes() == owned.numel() * 4
    alone = torch.randn(1, 4, 2, 3, 3)
    assert _own(alone) is alone  # no copy when it already owns its storage


def test_rk4_flow_step_many_rows_equal_each_requests_own_steps():
    # rk4_flow keys no batch (token2wav steps it alone), but its step_many is the joint one
    sampler = build_sampler("rk4_flow", {})
    n, shape = 3, (1, 6, 5)
    g = torch.Generator().manual_seed(0)
    alone, joint = [sampler.init_state(3) for _ in range(n)], [sampler.init_state(3) for _ in range(n)]
    xa = [torch.randn(shape, generator=g) for _ in range(n)]
    xj = torch.cat(xa)
    while not joint[0].done:
        outputs = [torch.randn(shape, generator=g) for _ in range(n)]
        xa = [sampler.step(s, v, x) for s, v, x in zip(alone, outputs, xa)]
        xj = sampler.step_many(joint, torch.cat(outputs), xj)
        assert torch.equal(xj, torch.cat(xa))
    assert all(s.done for s in alone)
