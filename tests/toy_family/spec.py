"""The toy family's ModelSpec + PipelineSpec, registered on import (``register_model_spec``),
and its TeaCache profile (``register_teacache_profile``): all the registration there is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omniloop.ext.cache.teacache import TeaCacheProfile, register_teacache_profile
from omniloop.models.load_options import apply_load_options
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import ClassicCFG
from omniloop.pipeline.policies.shift import FlowShift
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.samplers.sampler_set import SamplerSet, load_sampler_set
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stages import TextEncode, VAEDecode
from omniloop.request import Modality, OmniRequest, TaskType

from .presets import TOY_DEFAULTS
from .stages import ToyDenoiser
from .validate import make_validator
from .vae import SCALE_SPATIAL, SCALE_TEMPORAL
from .weights import PIPELINE_CLASS, load_component

FAMILY = "toy"
TASKS = frozenset({TaskType.T2V, TaskType.T2I})


def _loader(component: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        model = load_component(root / component, component, device=options.device, dtype=options.dtype)
        if component == "transformer":  # the deployment's attention backend, FP8 GEMMs, compile
            return apply_load_options(model, options, blocks=model.blocks, fp8_layers=r"^blocks\.\d+\.(self_attn|cross_attn|mlp)")
        return model

    return load


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return load_sampler_set(root / "scheduler")


def toy_variant(index: Mapping[str, Any]) -> Variant:
    weights = (
        WeightSpec(component="transformer", kind="ToyDiT", subfolder="transformer", load=_loader("transformer")),
        WeightSpec(component="vae", kind="ToyVAE", subfolder="vae", load=_loader("vae")),
        WeightSpec(component="text_encoder", kind="ToyTextEncoder (bytes)", subfolder="text_encoder",
                   load=_loader("text_encoder")),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    )
    return Variant(name="toy", tasks=TASKS, weights=weights)


def _wants_pixels(request: OmniRequest) -> bool:
    return request.outputs.wants(Modality.VIDEO) or request.outputs.wants(Modality.IMAGE)


def toy_pipeline_spec(variant: Variant) -> PipelineSpec:
    """Shared stages only: text encoding, the DenoiseLoop with the toy's adapter, VAE decode."""
    nodes = (
        Node("text_encode", TextEncode()),
        Node("denoise", DenoiseLoop(ToyDenoiser(), cfg=ClassicCFG(), shift=FlowShift())),
        Node("decode", VAEDecode(whole=None), when=opt("pixels wanted", _wants_pixels)),
    )
    return PipelineSpec(
        name=variant.name, family=FAMILY, tasks=variant.tasks,
        components=variant.component_specs(),
        nodes=nodes, outputs={"video": "video", "image": "image", "latents": "final_latents"},
    )


def build_toy(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    dit = components["transformer"]
    multiple = SCALE_SPATIAL * dit.config.patch_size
    defaults = TOY_DEFAULTS.replace(size_multiple=multiple, frames_per_latent=SCALE_TEMPORAL)
    return Pipeline(spec=toy_pipeline_spec(variant), components=components, device=options.device,
                    dtype=options.dtype, defaults=defaults,
                    validate_request=make_validator(defaults, components["sampler"], multiple))


TOY = register_model_spec(
    ModelSpec(family=FAMILY, diffusers_classes=(PIPELINE_CLASS,), variant=toy_variant, build=build_toy,
              description="the toy family of the tests: a two-block video DiT, byte text encoder, 4x decoder")
)

# TeaCache's view of ToyDiT: its blocks run as ToyBlock(x, context, modulation), so the
# timestep-modulated input is the call's second argument; the identity rescale (untrained).
TEACACHE = register_teacache_profile(FAMILY, TeaCacheProfile(
    modulated_input=lambda call: call.args[1], polynomials={"toy-identity": (1.0, 0.0)}, default="toy-identity"))
