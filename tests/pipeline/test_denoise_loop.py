"""DenoiseLoop policies and the per-request state rule."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.edges import TextEmbeddings
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiserBase
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import COND, UNCOND, ClassicCFG, EmbeddedGuidance
from omniloop.engine.offline import run_request
from omniloop.pipeline.samplers import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.stage import StageBase
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart


def _req(seed, steps=4, **kw):
    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text=f"prompt {seed}")],
                       diffusion=DiffusionParams(seed=seed, steps=steps, height=32, width=32, num_frames=5, **kw),
                       outputs=OutputSpec(return_latents=True))


def _start(gen, request):
    state = gen.pipeline.admit(request)
    gen.pipeline.spec.node("text_encode").stage.forward(gen.pipeline.contexts["text_encode"], state)
    node = gen.pipeline.spec.node("denoise")
    ctx = gen.pipeline.contexts["denoise"]
    return state, node.stage, ctx, node.stage.init(ctx, state)


@torch.inference_mode()
def test_interleaved_requests_equal_each_alone(wan_t2v_dir):
    """Two requests stepped alternately through ONE loop node (shared modules, shared
    sampler objects) produce bit-identical latents to each run alone."""
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    alone = [gen.generate(_req(s, steps=n)).artifacts["latents"].latents for s, n in ((1, 4), (2, 6))]

    (_, stage, ctx, la), (_, _, _, lb) = _start(gen, _req(1, steps=4)), _start(gen, _req(2, steps=6))
    while not (la.done and lb.done):
        for loop in (la, lb):
            if not loop.done:
                stage.step(ctx, loop)
    assert torch.equal(la.latents["video"], alone[0])
    assert torch.equal(lb.latents["video"], alone[1])


@torch.inference_mode()
def test_step_many_batches_requests_equal_unbatched(wan_t2v_dir):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    alone = [gen.generate(_req(s)).artifacts["latents"].latents for s in (5, 6)]
    (_, stage, ctx, la), (_, _, _, lb) = _start(gen, _req(5)), _start(gen, _req(6))
    assert stage.batch_key(la) == stage.batch_key(lb) is not None
    while not la.done:
        stage.step_many(ctx, [la, lb])
    # batched vs batch-1 DiT forward: not bit-exact on the CPU (GEMV vs GEMM), measured <= 2.2e-6
    assert torch.allclose(la.latents["video"], alone[0], atol=5e-6)
    assert torch.allclose(lb.latents["video"], alone[1], atol=5e-6)
    assert stage.batch_key(la) is None  # a finished loop is never batched


def test_node_params_override_steps_and_are_validated(wan_t2v_dir):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    req = _req(1, steps=4).model_copy(update={"node_params": {"denoise": {"steps": 2}}})
    out = gen.generate(req)
    assert out.metrics.steps == 2
    with pytest.raises(ValueError, match=r"node_params\['denoise'\]\.stepz: Extra inputs are not permitted"):
        gen.generate(_req(1).model_copy(update={"node_params": {"denoise": {"stepz": 2}}}))
    with pytest.raises(ValueError, match="node_params names unknown node 'refine'"):
        gen.generate(_req(1).model_copy(update={"node_params": {"refine": {"steps": 2}}}))


# -- policy unit tests on a two-modality fake model -------------------------------------


class FakeModel(torch.nn.Module):
    """pred[m] = x[m] * w + text offset (+ guidance); records each call's batch size."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))
        self.calls: list[dict] = []


@dataclass(frozen=True)
class FakeDenoiser(DenoiserBase):
    modalities: tuple = ("video", "audio")

    def latent_shapes(self, ctx, request):
        return {"video": (1, 2, 1, 2, 2), "audio": (1, 3, 4)}

    def branch_inputs(self, ctx, state, branches):
        text = ctx.read(state, "text", TextEmbeddings)
        out = {COND: {"text": text.prompt}}
        if UNCOND in branches:
            out[UNCOND] = {"text": text.negative}
        return out

    def forward(self, model, inputs, timestep, kwargs):
        model.calls.append({"batch": inputs["video"].shape[0], "kwargs": sorted(kwargs)})
        off = kwargs["text"].mean(dim=(1, 2))
        g = kwargs.get("guidance", torch.zeros_like(off))
        return {m: x * model.w + (off + g).view(-1, *[1] * (x.ndim - 1)) for m, x in inputs.items()}


@dataclass
class FakeText(StageBase):
    outputs = {"text": TextEmbeddings}

    def forward(self, ctx, state):
        ctx.write(state, "text", TextEmbeddings(prompt=torch.ones(1, 3, 4), negative=-torch.ones(1, 3, 4)))


def _fake_pipeline(cfg, guidance=1.0):
    loop = DenoiseLoop(FakeDenoiser(), cfg=cfg)
    spec = PipelineSpec(
        name="fake", family="fake", tasks=frozenset({TaskType.T2VS}),
        components={"transformer": ComponentSpec(name="transformer", kind="m"), "sampler": ComponentSpec(name="sampler", kind="s")},
        nodes=(Node("text", FakeText()), Node("denoise", loop)), outputs={"latents": "final_latents"},
    )
    model = FakeModel()
    sampler = SamplerSet.single("flow_euler", build_sampler("flow_euler", {"shift": 1.0}))
    return Pipeline(spec=spec, components={"transformer": model, "sampler": sampler}, device=torch.device("cpu"),
                    dtype=torch.float32, defaults=GenerationDefaults(steps=3, guidance_scale=guidance)), model


def _run(pipe, **params):
    req = OmniRequest(task=TaskType.T2VS, diffusion=DiffusionParams(seed=0, **params), outputs=OutputSpec(return_latents=True))
    out = run_request(pipe, req)
    assert out.status.value == "completed", out.error
    return out


def test_guidance_off_runs_one_branch():
    pipe, model = _fake_pipeline(ClassicCFG(), guidance=1.0)
    _run(pipe)
    assert len(model.calls) == 3 and all(c["batch"] == 1 for c in model.calls)


def test_sequential_vs_batched_dispatch():
    seq, m_seq = _fake_pipeline(ClassicCFG("sequential"), guidance=3.0)
    bat, m_bat = _fake_pipeline(ClassicCFG("batched"), guidance=3.0)
    a, b = _run(seq), _run(bat)
    assert [c["batch"] for c in m_seq.calls] == [1] * 6  # two forwards per step
    assert [c["batch"] for c in m_bat.calls] == [2] * 3  # one stacked forward per step
    assert torch.equal(a.artifacts["latents"].latents, b.artifacts["latents"].latents)  # elementwise model: bit for bit


def test_per_modality_scales_apply_to_their_modality():
    pipe, _ = _fake_pipeline(ClassicCFG(), guidance=1.0)
    state = pipe.admit(OmniRequest(task=TaskType.T2VS, diffusion=DiffusionParams(seed=0, guidance_scale={"video": 4.0, "audio": 2.0})))
    pipe.spec.node("text").stage.forward(pipe.contexts["text"], state)
    stage, ctx = pipe.spec.node("denoise").stage, pipe.contexts["denoise"]
    loop = stage.init(ctx, state)
    cfg_state = loop.policy_states["cfg"]
    assert cfg_state.branches == (COND, UNCOND)
    preds = {COND: {"video": torch.ones(1), "audio": torch.ones(1)}, UNCOND: {"video": torch.zeros(1), "audio": torch.zeros(1)}}
    out = stage.cfg.combine(cfg_state, preds, "primary")
    assert out["video"].item() == 4.0 and out["audio"].item() == 2.0


def test_embedded_guidance_is_single_branch_with_scale_in_forward():
    pipe, model = _fake_pipeline(EmbeddedGuidance(kwarg="guidance", multiplier=2.0), guidance=3.5)
    _run(pipe)
    assert len(model.calls) == 3 and all(c["kwargs"] == ["guidance", "text"] for c in model.calls)


def test_loop_state_holds_all_mutable_state():
    """The stage object (shared by every request) is unchanged by running requests."""
    pipe, _ = _fake_pipeline(ClassicCFG(), guidance=3.0)
    stage = pipe.spec.node("denoise").stage
    before = repr(stage.__dict__)
    _run(pipe), _run(pipe, steps=2)
    assert repr(stage.__dict__) == before
