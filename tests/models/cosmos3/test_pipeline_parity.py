"""Cosmos3 through our engine == diffusers' ``Cosmos3OmniPipeline`` on the same tiny random
checkpoint (fp32, CPU, same seed): T2I, T2V, I2V, V2W (video continuation), T2VS (joint
video + sound), and the action modes (forward dynamics, policy, inverse dynamics).

Measured: final latents within 4e-6 of diffusers' (values up to ~6), decoded frames within
one 8-bit level, sound within 1e-5, actions within 1e-5. The one departure from diffusers'
arithmetic is the time embedding: one row per sample instead of one per noisy token (same
values; a GEMM's rounding depends on its row count) -- with diffusers' per-token rows the
transformer forward is bit-identical (``test_forward_bit_identical_with_per_token_time_rows``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.cache.kv import KVBatch, KVHandle
from omniloop.engine import Engine
from omniloop.models.families.cosmos3.model import GenLayout, pack_sample
from omniloop.models.layers.wan_dit import sinusoidal_timestep_embedding
from omniloop.request import (
    ActionPart, DiffusionParams, ImagePart, Modality, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart,
)

diffusers = pytest.importorskip("diffusers")
pipeline_module = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")

LATENT_ATOL = 1e-4
PROMPT = "a red circle moving right"
STEPS, CFG, SEED = 2, 3.0, 7


def _image(w, h, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(n, w, h, seed=1):
    return [_image(w, h, seed + i) for i in range(n)]


def _run(pipeline, request):
    engine = Engine(pipeline)
    out = engine.run_until_done(engine.add_request(request))
    assert out.error is None, out.error
    return out


def _ours(pipeline, task, *, parts=(), frames=9, size=(64, 64), modalities=None, **denoise):
    diffusion = DiffusionParams(height=size[0], width=size[1], num_frames=frames, steps=STEPS, guidance_scale=CFG,
                                seed=SEED)
    request = OmniRequest(task=task, inputs=[TextPart(text=PROMPT), *parts], diffusion=diffusion,
                          outputs=OutputSpec(return_latents=True, modalities=modalities),
                          node_params={"denoise": denoise} if denoise else {})
    return _run(pipeline, request)


def _theirs(ref, **kwargs):
    """diffusers' decoded output (np) and, through the step callback, its final latents."""
    last = {}

    def keep(pipe, i, t, tensors):
        last["latents"] = tensors["latents"].clone()
        return tensors

    with torch.no_grad():
        out = ref(PROMPT, num_inference_steps=STEPS, guidance_scale=CFG, generator=torch.Generator().manual_seed(SEED),
                  output_type="np", callback_on_step_end=keep, **kwargs)
    return last["latents"], out


def _check_video(out, latent, video, image=False):
    torch.testing.assert_close(out.artifacts["latents"].latents, latent, rtol=0, atol=LATENT_ATOL)
    frames = out.artifacts["image"].image[None] if image else out.artifacts["video"].frames
    want = torch.from_numpy((np.asarray(video.video) * 255).round().astype(np.uint8))
    assert frames.shape == want.shape
    assert (frames.int() - want.int()).abs().max() <= 1


@pytest.mark.parametrize("task", [TaskType.T2V, TaskType.T2I])
def test_text_to_video_and_image(cosmos3_pipeline, cosmos3_ref, task):
    frames = 1 if task is TaskType.T2I else 9
    out = _ours(cosmos3_pipeline, task, frames=frames)
    latent, video = _theirs(cosmos3_ref, num_frames=frames, height=64, width=64)
    _check_video(out, latent, video, image=task is TaskType.T2I)


def test_image_to_video(cosmos3_pipeline, cosmos3_ref):
    img = _image(80, 72)
    out = _ours(cosmos3_pipeline, TaskType.I2V, parts=[ImagePart(data=img)])
    latent, video = _theirs(cosmos3_ref, image=img, num_frames=9, height=64, width=64)
    _check_video(out, latent, video)


def test_video_continuation(cosmos3_pipeline, cosmos3_ref):
    clip = _video(9, 64, 64)
    out = _ours(cosmos3_pipeline, TaskType.V2W, parts=[VideoPart(data=clip)], condition_frames=[0, 1])
    latent, video = _theirs(cosmos3_ref, video=clip, condition_frame_indexes_vision=[0, 1], num_frames=9, height=64,
                            width=64)
    _check_video(out, latent, video)


def test_joint_video_and_sound(cosmos3_pipeline, cosmos3_ref):
    out = _ours(cosmos3_pipeline, TaskType.T2VS)
    latent, video = _theirs(cosmos3_ref, num_frames=9, height=64, width=64, enable_sound=True)
    _check_video(out, latent, video)
    audio = out.artifacts["audio"]
    assert audio.sample_rate == cosmos3_ref.sound_tokenizer.config.sampling_rate
    torch.testing.assert_close(audio.samples, video.sound.float(), rtol=0, atol=1e-5)


def _action(mode, **kw):
    return pipeline_module.CosmosActionCondition(mode=mode, chunk_size=4, domain_name="bridge_orig_lerobot",
                                                 resolution_tier=256, **kw)


ACTIONS = torch.linspace(-1, 1, 40).reshape(4, 10)


def test_forward_dynamics(cosmos3_pipeline, cosmos3_ref):
    img = _image(96, 64)
    out = _ours(cosmos3_pipeline, TaskType.A2W, parts=[ImagePart(data=img), ActionPart(values=ACTIONS.tolist())],
                frames=None, domain="bridge_orig_lerobot", resolution_tier=256)
    latent, video = _theirs(cosmos3_ref, action=_action("forward_dynamics", raw_actions=ACTIONS, image=img))
    _check_video(out, latent, video)
    assert "action" not in out.artifacts


@pytest.mark.parametrize("mode", ["policy", "inverse_dynamics"])
def test_policy_and_inverse_dynamics(cosmos3_pipeline, cosmos3_ref, mode):
    if mode == "policy":
        img = _image(96, 64)
        parts, kw, modalities = [ImagePart(data=img)], dict(image=img), [Modality.VIDEO, Modality.ACTION]
    else:
        clip = _video(5, 96, 64)
        parts, kw, modalities = [VideoPart(data=clip)], dict(video=clip), [Modality.ACTION]
    out = _ours(cosmos3_pipeline, TaskType.V2W, parts=parts, frames=5, modalities=modalities,
                domain="bridge_orig_lerobot", resolution_tier=256)
    latent, video = _theirs(cosmos3_ref, action=_action(mode, **kw))
    torch.testing.assert_close(out.artifacts["latents"].latents, latent, rtol=0, atol=LATENT_ATOL)
    actions = out.artifacts["action"].tensor
    assert actions.shape == (4, 10)
    torch.testing.assert_close(actions, video.action[0].float(), rtol=0, atol=1e-5)
    assert ("video" in out.artifacts) == (mode == "policy")


@torch.no_grad()
def test_forward_bit_identical_with_per_token_time_rows(cosmos3_pipeline, cosmos3_ref):
    """One transformer forward (the text prefilled into a KV once, the generation tokens
    attending it) with the time embedding computed on diffusers' per-token rows: torch.equal
    to diffusers' joint forward."""
    ours, ref = cosmos3_pipeline.components["transformer"], cosmos3_ref.transformer
    cfg = ours.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=g)
    vision = torch.randn(1, 48, 3, 4, 4, generator=g)
    layout = GenLayout((48, 3, 4, 4), 2, (1, 2))
    seq = pack_sample(cfg, layout, 11, fps=24.0, frames_per_latent=4)
    t = 700
    vis = seq.index(modality="vision")
    (pv,), _, _ = ref(
        input_ids=ids, text_indexes=torch.arange(11), position_ids=seq.positions, und_len=11,
        sequence_length=seq.num_tokens, vision_tokens=[vision], vision_token_shapes=[(3, 2, 2)],
        vision_sequence_indexes=vis, vision_mse_loss_indexes=vis[4:], vision_timesteps=torch.full((8,), t),
        vision_noisy_frame_indexes=[torch.tensor([1, 2])], return_dict=False)
    from omniloop.models.families.cosmos3.stages import GenContext

    handle = KVHandle(cfg.kv_layout, dtype=torch.float32, device="cpu")
    ours.forward_text(ids[None], KVBatch([handle], 11))
    cos, sin = ours.rope(seq.positions[:, 11:][:, None])
    rows = ours.time_embedder(sinusoidal_timestep_embedding(torch.full((8,), t) * cfg.timestep_scale, 256))[:1]
    x = ours.embed_gen(layout, vision, torch.tensor([t]), temb=rows)
    preds = ours.decode_gen(layout, ours.forward_gen(x, cos, sin, GenContext(layout, [handle], cos, sin)))
    assert torch.equal(preds["video"], pv)
    # our own per-sample time embedding: the same up to GEMM rounding
    x = ours.embed_gen(layout, vision, torch.tensor([t]))
    ours_video = ours.decode_gen(layout, ours.forward_gen(x, cos, sin, GenContext(layout, [handle], cos, sin)))["video"]
    torch.testing.assert_close(ours_video, pv, rtol=0, atol=1e-5)
