"""Flux parallelized from outside (models/families/flux/parallelize.py) on 2 gloo ranks equals
one process.

The DiT alone, on packed inputs of three sizes (the mixed-size path: per-sample attention over
segments of unequal lengths; a window of the joint tokens cuts through samples), on one
sample, and on two samples of one size (the uniform path): Ulysses is bit-identical (each
rank runs the same per-sample kernel on whole heads after the all-to-all); tp differs by
float32 reassociation of the all-reduced partial sums (measured max |diff| ~3e-7 on outputs
~1; TOL 2e-6). Through the pool (``VideoGenerator(parallel=...)``): sp=2 latents bit for bit,
tp=2 within 1e-5 (measured 3.6e-7 on latents ~3), and dp=2 splits a batched step of two requests
of different sizes across the ranks (measured 4.8e-7 vs the one-process batched step; TOL 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.parallel.spec import ParallelSpec
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, run_ranks, threads

TOL = 2e-6
# (image grid (h, w) in 2x2 patches, text tokens) per sample of each packed forward
CASES = (((2, 3), 5), ((3, 2), 7), ((1, 4), 5)), (((3, 3), 6),), (((2, 2), 3), ((2, 2), 3))


def _model():
    from omniloop.models.families.flux.model import FluxConfig, FluxTransformer

    torch.manual_seed(0)
    config = FluxConfig(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8,
                        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=24,
                        guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    return FluxTransformer(config).eval()


def _inputs(case):
    from omniloop.models.families.flux.model import FluxInputs
    from omniloop.models.layers.packed import Segments

    g = torch.Generator().manual_seed(len(case))
    ids = [torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)), indexing="ij"),
                       -1).reshape(-1, 3) for (h, w), _ in case]
    n = len(case)
    return FluxInputs(
        image=torch.randn(sum(h * w for (h, w), _ in case), 16, generator=g),
        text=torch.randn(sum(t for _, t in case), 32, generator=g),
        pooled=torch.randn(n, 24, generator=g), timestep=torch.rand(n, generator=g),
        guidance=torch.full((n,), 3.5), image_ids=torch.cat(ids), text_ids=torch.zeros(sum(t for _, t in case), 3),
        image_segments=Segments(tuple(h * w for (h, w), _ in case)), text_segments=Segments(tuple(t for _, t in case)))


def _parallel_outputs(rank, world, specs):
    from omniloop.models.families.flux.parallelize import FLUX_PARALLEL
    from omniloop.parallel.apply import parallelize_model
    from omniloop.parallel.mesh import ParallelMesh

    out = {}
    for text in specs:
        model = _model()
        parallelize_model(model, FLUX_PARALLEL, ParallelMesh.build(ParallelSpec.from_flag(text), torch.device("cpu")))
        with torch.inference_mode():
            out[text] = [model(_inputs(case)) for case in CASES]
    return out


def test_flux_dit_on_two_ranks_equals_one_process():
    specs = ("ulysses=2", "tp=2")
    results = run_ranks(_parallel_outputs, 2, specs)
    model = _model()
    with torch.inference_mode(), threads(rank_threads(2)):
        reference = [model(_inputs(case)) for case in CASES]
    errors = {}
    for rank_out in results:
        for text in specs:
            for got, ref in zip(rank_out[text], reference):
                assert got.shape == ref.shape
                errors[text] = max(errors.get(text, 0.0), (got - ref).abs().max().item())
    assert errors["ulysses=2"] == 0.0, errors  # whole heads per rank, per-sample attention: bitwise
    assert 0 < errors["tp=2"] <= TOL, errors  # partial sums really were all-reduced


def _request(rid="img", seed=3, height=32, width=48):
    return OmniRequest(request_id=rid, task=TaskType.T2I, inputs=[TextPart(text=f"a shape number {seed}")],
                       diffusion=DiffusionParams(height=height, width=width, steps=2, seed=seed, guidance_scale=3.0),
                       outputs=OutputSpec(return_latents=True))


REQUESTS = (("a", 1, 32, 48), ("b", 2, 48, 32))  # two sizes: a dp=2 step packs them, one per rank


@pytest.fixture(scope="module")
def one_process(flux_dir):
    gen = VideoGenerator.from_pretrained(flux_dir, device="cpu", dtype="float32")
    with torch.inference_mode(), threads(rank_threads(2)):
        solo = gen.generate(_request()).artifacts["latents"].latents
        engine = gen.engine
        for args in REQUESTS:
            engine.add_request(_request(*args))
        while engine.has_unfinished():
            engine.step()
        batched = {rid: engine.pop_output(rid).artifacts["latents"].latents for rid, *_ in REQUESTS}
    return solo, batched


@pytest.mark.parametrize("spec", ["sp=2", "tp=2", "dp=2"])
def test_flux_through_the_pool_equals_one_process(flux_dir, one_process, spec):
    solo, batched = one_process
    with VideoGenerator.from_pretrained(flux_dir, device="cpu", dtype="float32", parallel=spec) as gen:
        if spec != "dp=2":
            out = gen.generate(_request())
            assert out.status.value == "completed", out.error
            got = out.artifacts["latents"].latents
            if spec == "sp=2":
                assert torch.equal(got, solo)  # Ulysses: bitwise through the whole loop too
            assert (got - solo).abs().max().item() < 1e-5
            return
        engine = gen.engine
        with torch.inference_mode():
            for args in REQUESTS:
                engine.add_request(_request(*args))
            while engine.has_unfinished():
                engine.step()
        assert engine.stats.batched_steps > 0
        for rid, *_ in REQUESTS:
            got = engine.pop_output(rid).artifacts["latents"].latents
            assert (got - batched[rid]).abs().max().item() < 1e-5


def test_flux_preflight_refuses_ring_and_cfg_naming_what_works(flux_dir):
    facts = model_facts(flux_dir)
    assert facts.family == "flux" and dict(facts.heads) == {"transformer": 2}
    check_model(ParallelSpec.from_flag("ulysses=2,dp=2"), facts)
    with pytest.raises(ValueError, match=r"ring=2: the sequence of 'flux' packs samples end to end.*parallel='dp=2'"):
        check_model(ParallelSpec.from_flag("ring=2"), facts)
    with pytest.raises(ValueError, match=r"cfg=2: the loops of 'flux' run one guidance branch.*parallel='dp=2,"
                                         r"ulysses=2'"):
        check_model(ParallelSpec.from_flag("cfg=2,ulysses=2"), facts)
    with pytest.raises(ValueError, match=r"ulysses=4 does not divide the 2 attention heads.*parallel='dp=2,ulysses=2'"):
        check_model(ParallelSpec.from_flag("ulysses=4"), facts)
