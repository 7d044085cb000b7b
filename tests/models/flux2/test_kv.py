"""FLUX.2 [klein] KV (diffusers 0.42.1 ``Flux2KleinKVPipeline``): the references' keys/values
computed once per request and reused by every step, on a tiny random checkpoint saved by
``Flux2KleinKVPipeline.save_pretrained`` (fp32, CPU, same seed).

Measured: bit-exact (torch.equal) latents and pixels for edits with one and with two
reference images, from a Flux2KleinKVPipeline folder and from a klein folder whose request
asks for the cache (``node_params['denoise'].reference_kv``); the cached path embeds the
reference tokens once instead of once per step; cached edits batch with each other (equal
reference token counts, even of other grids) and equal their solo runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.errors import RequestRejected
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import run_recorded
from tests.models.flux2.helpers import PROMPT, generator, klein_pipeline, klein_run

H, W = 32, 48


def _picture(seed: int, h: int = 64, w: int = 64):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _edit(refs, *, request_id=None, node_params=None, **params) -> OmniRequest:
    extra = {"request_id": request_id} if request_id else {}
    return OmniRequest(task=TaskType.I2I, inputs=[TextPart(text=PROMPT), *[ImagePart(data=r) for r in refs]],
                       diffusion=DiffusionParams(**params), outputs=OutputSpec(return_latents=True),
                       node_params=node_params or {}, **extra)


def _uint8(pixels: np.ndarray) -> np.ndarray:
    return np.round(pixels[0] * 255).astype(np.uint8)


def _ours(folder, request):
    out = generator(folder).generate(request)
    assert out.status.value == "completed", out.error
    return out


def test_kv_edits_equal_klein_kv_pipeline(klein_kv_dir, klein_dir):
    """One reference (the output takes its size), then two of different sizes (t = 10, 20);
    the klein folder with ``reference_kv`` runs the same computation."""
    first, second = _picture(0, 70, 99), _picture(1)  # the first is encoded at 96x64 (center crop)
    pipe = klein_pipeline(klein_kv_dir, kv=True)
    out = _ours(klein_kv_dir, _edit([first], steps=3, seed=3))
    latents, pixels = klein_run(pipe, 64, 96, 3, image=[first], prompt=PROMPT, num_inference_steps=3)
    assert out.image.image.shape == (64, 96, 3)
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))

    latents, pixels = klein_run(pipe, H, W, 4, image=[first, second], prompt=PROMPT, num_inference_steps=2)
    out = _ours(klein_kv_dir, _edit([first, second], height=H, width=W, steps=2, seed=4))
    assert torch.equal(out.artifacts["latents"].latents, latents)
    assert np.array_equal(out.image.image.numpy(), _uint8(pixels))
    asked = _ours(klein_dir, _edit([first, second], height=H, width=W, steps=2, seed=4,
                                   node_params={"denoise": {"reference_kv": True}}))
    assert torch.equal(asked.artifacts["latents"].latents, latents)


def _embedded_rows(pipeline, request) -> int:
    """Token rows the DiT's input projection embeds over the whole request."""
    rows = []
    dit = pipeline.components["transformer"]
    handle = dit.x_embedder.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:2].numel()))
    try:
        engine = Engine(pipeline, EngineConfig())
        engine.add_request(request)
        while engine.has_unfinished():
            engine.step()
    finally:
        handle.remove()
    return sum(rows)


def test_cached_path_embeds_reference_tokens_once(klein_dir):
    klein = load_pipeline(klein_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    refs, steps = [_picture(0), _picture(1)], 4  # 2 x 4x4 reference tokens, a 2x3 image
    plain = _embedded_rows(klein, _edit(refs, height=H, width=W, steps=steps, seed=0))
    cached = _embedded_rows(klein, _edit(refs, height=H, width=W, steps=steps, seed=0,
                                         node_params={"denoise": {"reference_kv": True}}))
    assert plain == steps * (6 + 32)  # every step carries the 32 reference tokens
    assert cached == 32 + steps * 6  # once, then the image tokens alone

    # admission's memory estimate holds the cache while the loop runs: (k, v) x 4 blocks x 32 tokens x 32 wide
    engine = Engine(klein, EngineConfig())
    for rid, knob in (("plain", None), ("cached", True)):
        engine.add_request(_edit(refs, request_id=rid, height=H, width=W, node_params={"denoise": {"reference_kv": knob}}))
    loop_bytes = {rid: engine._requests[rid].estimates.nodes["denoise"].loop_bytes for rid in ("plain", "cached")}
    assert loop_bytes["cached"] - loop_bytes["plain"] == 2 * 4 * 32 * 32 * 4


def _run(pipeline, reqs):
    # every prologue item (encoders, loop inits: the reference pass) first, so the steps group
    # the same way whatever the measured costs
    outs, plans = run_recorded(pipeline, reqs, max_batch=8, max_running=8, prologue_share=1e9)
    return outs, [sorted(ids) for ids in plans.step_groups()]


def test_cached_edits_batch_and_equal_their_solo_runs(klein_kv_dir):
    """Cached edits batch at equal reference token counts, whatever their grids (the positions
    are rotated into the cached keys); a text-to-image request of the same size runs beside."""
    kv = load_pipeline(klein_kv_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    t2i = OmniRequest(request_id="t", task=TaskType.T2I, inputs=[TextPart(text="a shape")],
                      diffusion=DiffusionParams(height=H, width=W, steps=2, seed=9),
                      outputs=OutputSpec(return_latents=True))
    size = {"height": H, "width": W, "steps": 2}
    reqs = [_edit([_picture(0)], request_id="a", seed=1, **size),  # one 4x4 grid: 16 reference tokens
            _edit([_picture(1)], request_id="d", seed=4, **size),
            _edit([_picture(2, 64, 128)], request_id="b", seed=2, **size),  # one 4x8 grid: 32 tokens
            _edit([_picture(3), _picture(4)], request_id="c", seed=3, **size),  # two 4x4 grids: 32 tokens
            t2i]
    outs, groups = _run(kv, reqs)
    # b and c: other grids, 32 reference tokens each; t (no reference cache) runs beside
    assert sorted(groups) == [["a", "d"]] * 2 + [["b", "c"]] * 2 + [["t"]] * 2
    for r in reqs[2:4]:  # the pair of other grids
        solo = _run(kv, [r])[0][r.request_id].artifacts["latents"].latents
        assert (outs[r.request_id].artifacts["latents"].latents - solo).abs().max() <= 2e-6  # batched GEMMs


@pytest.mark.parametrize("node_params, field", [
    ({"denoise": {"reference_kv": False}}, "node_params['denoise'].reference_kv"),  # a KV model always caches
    ({"denoise": {"reference_kv": "sometimes"}}, "node_params"),
])
def test_bad_cache_options_are_refused_naming_the_field(klein_kv_dir, node_params, field):
    kv = load_pipeline(klein_kv_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    with pytest.raises(RequestRejected) as e:
        Engine(kv, EngineConfig()).add_request(_edit([_picture(0)], node_params=node_params))
    assert any(f.startswith(field) for f in e.value.fields), (e.value, e.value.fields)


def test_flux2_dev_refuses_the_reference_cache(flux2_dev_dir):
    dev = load_pipeline(flux2_dev_dir, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    with pytest.raises(RequestRejected, match="reference_kv") as e:
        Engine(dev, EngineConfig()).add_request(_edit([_picture(0)], node_params={"denoise": {"reference_kv": True}}))
    assert "node_params['denoise'].reference_kv" in e.value.fields


def test_reference_kv_is_a_flat_loop_knob_of_flux2():
    """The API, the CLI (``--knob reference_kv=true``) and the HTTP fields take it flat."""
    from omniloop.models.families.flux2.spec import flux2_pipeline_spec, flux2_variant
    from omniloop.pipeline.knobs import knob_table
    from omniloop.request.builder import build_request, generation_fields

    table = knob_table(flux2_pipeline_spec(flux2_variant({"_class_name": "Flux2KleinPipeline", "is_distilled": True})))
    fields = generation_fields({"num_inference_steps": 2, "reference_kv": True}, knobs=table)
    request = build_request(TaskType.I2I, PROMPT, fields, parts=[ImagePart(data=_picture(0))], knobs=table)
    assert request.node_params == {"denoise": {"reference_kv": True}} and request.diffusion.steps == 2
