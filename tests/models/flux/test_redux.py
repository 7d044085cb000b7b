"""FLUX.1 Redux parity against diffusers' ``FluxPriorReduxPipeline`` + ``FluxPipeline`` on a
tiny random folder (tests/flux_redux_checkpoint.py; fp32, CPU, same seed): the prior's
prompt embeds (the prompt's T5 tokens, then the SigLIP -> Redux tokens, scaled and summed
over images) and pooled embeds, and the image FluxPipeline makes from them.

Measured: bit-exact (torch.equal) for the prior's outputs; the final latents within 3.6e-7 (of
values up to 2.5; bit-exact in a fresh one-thread process): with 521 text tokens the GEMMs'
split over threads rounds differently between our packed forward and diffusers' batched one."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from omniloop.pipeline.edges import TextEmbeddings
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

def _image(w: int, h: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _request(images, prompt=PROMPT, rid="r0", node_params=None, steps=2):
    parts = ([TextPart(text=prompt)] if prompt is not None else []) + [ImagePart(data=im, role="reference")
                                                                        for im in images]
    return OmniRequest(request_id=rid, task=TaskType.T2I, inputs=parts,
                       diffusion=DiffusionParams(height=32, width=32, steps=steps, seed=3, guidance_scale=2.5),
                       node_params=node_params or {}, outputs=OutputSpec(return_latents=True))


@functools.lru_cache(maxsize=2)
def _prior(folder):
    """diffusers' prior with the Flux folder's text encoders (its prompt path)."""
    from diffusers import FluxPriorReduxPipeline

    base = diffusers_pipeline(folder)
    prior = FluxPriorReduxPipeline.from_pretrained(folder / "_redux", torch_dtype=torch.float32,
                                                   text_encoder=base.text_encoder, tokenizer=base.tokenizer,
                                                   text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2)
    for module in (prior.image_encoder, prior.image_embedder):
        for p in module.parameters():
            p.data = p.data.clone()
    return prior


def _ours(folder, request) -> TextEmbeddings:
    """Our pipeline's ``text`` edge for ``request`` (the text and redux nodes run)."""
    pipeline = generator(folder).pipeline
    state = pipeline.admit(request)
    for node in pipeline.active_nodes(state.request):
        if node.name in ("text_encode", "redux"):
            node.stage.forward(pipeline.contexts[node.name], state)
    return state.artifacts["text"]


def _zeros(prior, n):  # what diffusers' prior without text encoders starts from, at this DiT's widths
    return torch.zeros(n, 512, prior.image_embedder.config.txt_in_features), torch.zeros(n, 24)


def test_redux_folder_loads_with_a_redux_node(flux_redux_dir):
    pipeline = generator(flux_redux_dir).pipeline
    assert [n.name for n in pipeline.spec.nodes][:2] == ["text_encode", "redux"]
    assert {"image_encoder", "image_embedder"} <= set(pipeline.components)


@pytest.mark.parametrize("case", ["prompt", "no_prompt", "two_images_scaled"])
def test_prior_equals_flux_prior_redux_pipeline(flux_redux_dir, case):
    prior = _prior(flux_redux_dir)
    images = [_image(50, 30, 1)] + ([_image(40, 40, 2)] if case == "two_images_scaled" else [])
    scales = {"prompt_embeds_scale": [1.0, 0.5], "pooled_prompt_embeds_scale": [0.75, 0.25]} \
        if case == "two_images_scaled" else {}
    if case == "no_prompt":
        zeros, pooled_zeros = _zeros(prior, len(images))
        want = prior(image=images, prompt_embeds=zeros, pooled_prompt_embeds=pooled_zeros)
    else:
        want = prior(image=images, prompt=PROMPT, **scales)
    got = _ours(flux_redux_dir, _request(images, None if case == "no_prompt" else PROMPT,
                                         node_params={"redux": scales} if scales else None))
    assert got.prompt.shape == want.prompt_embeds.shape == (1, 512 + 9, 32)
    assert torch.equal(got.prompt, want.prompt_embeds)
    assert torch.equal(got.pooled, want.pooled_prompt_embeds)


def test_variation_equals_flux_pipeline_fed_the_prior(flux_redux_dir):
    image = _image(60, 44, 4)
    prior = _prior(flux_redux_dir)
    zeros, pooled_zeros = _zeros(prior, 1)
    embeds = prior(image=image, prompt_embeds=zeros, pooled_prompt_embeds=pooled_zeros)
    want = diffusers_latents(diffusers_pipeline(flux_redux_dir), 32, 32, 3, prompt_embeds=embeds.prompt_embeds,
                             pooled_prompt_embeds=embeds.pooled_prompt_embeds, num_inference_steps=2, guidance_scale=2.5)
    out = generator(flux_redux_dir).generate(_request([image], prompt=None))
    assert out.status.value == "completed", out.error
    assert (out.artifacts["latents"].latents - want).abs().max() <= 1e-6


def test_concat_is_comfyui_style_model_apply(flux_redux_dir):
    """combine='concat': the prompt's tokens, then each image's tokens times its strength."""
    images = [_image(50, 30, 1), _image(40, 40, 2)]
    prior = _prior(flux_redux_dir)
    # each image's Redux tokens alone: an empty prompt, the other image's scale 0 (x * 1 + y * 0 is x)
    one = [prior(image=images, prompt_embeds=torch.zeros(2, 0, 32), pooled_prompt_embeds=torch.zeros(2, 24),
                 prompt_embeds_scale=scale).prompt_embeds for scale in ([1.0, 0.0], [0.0, 1.0])]
    plain = _ours(flux_redux_dir, _request([], rid="p"))
    got = _ours(flux_redux_dir, _request(images, node_params={"redux": {"combine": "concat", "strength": [1.0, 0.5]}}))
    assert torch.equal(got.prompt, torch.cat([plain.prompt, one[0], one[1] * 0.5], dim=1))
    assert torch.equal(got.pooled, plain.pooled)


def test_requests_without_a_reference_are_unchanged(flux_redux_dir, flux_dir):
    req = OmniRequest(request_id="t", task=TaskType.T2I, inputs=[TextPart(text=PROMPT)],
                      diffusion=DiffusionParams(height=32, width=32, steps=2, seed=3),
                      outputs=OutputSpec(return_latents=True))
    a = generator(flux_redux_dir).generate(req).artifacts["latents"].latents
    b = generator(flux_dir).generate(req).artifacts["latents"].latents
    assert torch.equal(a, b)


def test_bad_redux_requests_are_refused(flux_redux_dir, flux_dir):
    from omniloop.request import InvalidRequest

    pipeline = generator(flux_redux_dir).pipeline
    with pytest.raises(InvalidRequest, match=r"prompt_embeds_scale has 3 values for 1 reference"):
        pipeline.admit(_request([_image(20, 20)], node_params={"redux": {"prompt_embeds_scale": [1.0, 1.0, 1.0]}}))
    with pytest.raises(InvalidRequest, match=r"strength does not apply to combine='sum'"):
        pipeline.admit(_request([_image(20, 20)], node_params={"redux": {"strength": 0.5}}))
    with pytest.raises(ValueError, match=r"node_params\['redux'\]"):
        pipeline.admit(_request([_image(20, 20)], node_params={"redux": {"combine": "mean"}}))
    edit = pipeline.admit(_request([_image(32, 32)]).model_copy(update={"task": TaskType.I2I}))
    assert {"text_encode", "redux", "image_condition"} <= {n.name for n in pipeline.active_nodes(edit.request)}
    plain = generator(flux_dir).pipeline
    with pytest.raises(InvalidRequest, match=r"no Redux components.*image_embedder/ \(ReduxImageEncoder\)"):
        plain.admit(_request([_image(20, 20)]))


def test_redux_requests_share_steps_and_equal_solo(flux_redux_dir):
    """Two Redux requests (different images and prompts: 521 text tokens each) step together
    in one packed forward; each equals its solo run within the packed GEMMs' rounding
    (tests/models/flux/test_packing.py)."""
    from tests.engine_plans import run_recorded

    pipeline = generator(flux_redux_dir).pipeline
    reqs = [_request([_image(50, 30, 1)], prompt="a blue square", rid="a"), _request([_image(40, 40, 2)], rid="b")]
    outs, plans = run_recorded(pipeline, reqs, max_batch=2, max_running=2)
    assert plans.batch_sizes() == [2, 2]
    for r in reqs:
        solo = generator(flux_redux_dir).generate(r.model_copy(update={"request_id": r.request_id + "-solo"}))
        err = (outs[r.request_id].artifacts["latents"].latents - solo.artifacts["latents"].latents).abs().max()
        assert err <= 2e-6, err  # measured: 3.6e-7, 5.7e-7
