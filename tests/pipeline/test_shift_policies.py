"""Shift policies: what each hands ``Sampler.init_state`` for a request and its latent shapes."""

from __future__ import annotations

import numpy as np

from omniloop.pipeline.policies.shift import DynamicShift, FlowShift
from omniloop.pipeline.samplers.flow_euler import FlowEulerSampler
from omniloop.request import DiffusionParams

DYNAMIC = FlowEulerSampler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                           max_image_seq_len=4096)
STATIC = FlowEulerSampler(shift=3.0)


def test_dynamic_shift_counts_patched_image_tokens_or_packed_tokens():
    params = DiffusionParams(steps=4)
    image = {"image": (1, 16, 64, 32)}  # Flux: 64*32 latent pixels, 2x2 a token
    got = DynamicShift().sampler_kwargs(params, image, 4, DYNAMIC)
    assert got == {"mu": DYNAMIC.mu_for_seq_len(64 * 32 // 4), "sigmas": np.linspace(1.0, 0.25, 4).tolist()}
    packed = {"video": (1, 768, 128), "audio": (1, 9, 16)}  # LTX-2: video latents packed [B, L, C]
    got = DynamicShift(packed="video").sampler_kwargs(params, packed, 4, DYNAMIC)
    assert got["mu"] == DYNAMIC.mu_for_seq_len(768)


def test_dynamic_shift_keeps_given_sigmas_and_a_static_sampler_gets_the_requests_shift():
    params = DiffusionParams(steps=3, sigmas=[1.0, 0.5, 0.2])
    assert DynamicShift(packed="video").sampler_kwargs(params, {"video": (1, 8, 8)}, 3, DYNAMIC)["sigmas"] == [1.0, 0.5, 0.2]
    shifted = DiffusionParams(steps=2, shift=5.0)
    assert DynamicShift(packed="video").sampler_kwargs(shifted, {"video": (1, 8, 8)}, 2, STATIC) == {
        "shift": 5.0, "sigmas": [1.0, 0.5]}
    assert DynamicShift().sampler_kwargs(DiffusionParams(steps=2), {"image": (1, 16, 8, 8)}, 2, STATIC)["shift"] is None


def test_flow_shift_table_by_latent_area():
    policy = FlowShift(default=3.0, table=((16 * 16, 1.0), (64 * 64, 2.0)))
    params = DiffusionParams(steps=2)
    assert policy.sampler_kwargs(params, {"video": (1, 16, 3, 16, 16)}, 2, STATIC)["shift"] == 1.0
    assert policy.sampler_kwargs(params, {"video": (1, 16, 3, 32, 32)}, 2, STATIC)["shift"] == 2.0
    assert policy.sampler_kwargs(params, {"video": (1, 16, 3, 90, 90)}, 2, STATIC)["shift"] == 3.0
    assert policy.sampler_kwargs(DiffusionParams(steps=2, shift=7.0), {"video": (1, 16, 3, 16, 16)}, 2, STATIC)["shift"] == 7.0
