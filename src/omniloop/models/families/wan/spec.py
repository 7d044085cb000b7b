"""Wan family ModelSpecs: Wan2.1 T2V, Wan2.2 two-expert T2V, Wan2.2 I2V (latent concat),
Wan2.1 I2V / FLF2V (latent concat + CLIP image tokens), and Wan models in our manifest
layout (``omniloop_model.json``: the shapes-world models).

Variants are read from ``model_index.json``: ``transformer_2`` + ``boundary_ratio`` make a
two-expert model; ``WanImageToVideoPipeline`` without an image encoder is Wan2.2 I2V, with
one (``image_encoder`` + ``image_processor``) Wan2.1 I2V. Every I2V variant takes a last
frame too (FLF2V) where its DiT can: see ``validate.py``. A manifest names its variant,
text encoder (``minilm``), sampler and generation defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omniloop.ext.cache.teacache import TeaCacheProfile, register_teacache_profile
from omniloop.models.load_options import apply_load_options
from omniloop.models.manifest import ModelLimits, ModelManifest, check_manifest, manifest_class_name, manifest_weights
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.text.umt5 import load_umt5_encoder, load_umt5_encoder_single_file
from omniloop.models.vision.clip_vision import load_clip_vision_encoder, load_clip_vision_single_file
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode, ClassicCFG
from omniloop.pipeline.policies.conditioning import LatentConcat, NoConditioning
from omniloop.pipeline.policies.routing import BoundaryTimestepRouting, SingleModel
from omniloop.pipeline.policies.shift import FlowShift
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.samplers.sampler_set import SamplerSet, flow_sampler_set, load_sampler_set
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.loops.decode import VideoDecodeLoop
from omniloop.pipeline.stages import LATENTS_GIVEN, GivenLatents, TextEncode
from omniloop.models.families.wan.parallelize import WAN_PARALLEL
from omniloop.models.families.wan.presets import ANIMATE_DEFAULTS, TEACACHE_DEFAULT, TEACACHE_POLYNOMIALS, TI2V_DEFAULTS, WAN_DEFAULTS
from omniloop.models.families.wan.stages import (IMAGE_ENCODE_NODE, WanDenoiseLoop, WanDenoiser, WanImageCondition, WanImageEncode,
                                                 WanVideoEncode, first_frame)
from omniloop.models.families.wan.ti2v import FirstFrameLatents, Ti2vDenoiser, Ti2vImageCondition
from omniloop.models.families.wan.animate import AnimateDenoiser, AnimateImageEncode, animate_validator
from omniloop.models.families.wan.animate_rollout import AnimateDenoiseLoop, AnimateRollout
from omniloop.models.families.wan.animate_dit import WanAnimateDiT
from omniloop.models.families.wan.vace import VaceCondition, VaceDenoiseLoop, VaceDenoiser
from omniloop.models.families.wan.validate import make_validator, size_caps, vace_validator
from omniloop.models.families.wan.model import WanVaceDiT
from omniloop.models.families.wan.weights import dit_state_dict_from_diffusers, load_wan_dit, load_wan_dit_single_file
from omniloop.models.autoencoders.wan_vae import deploy_fused, load_wan_vae_single_file, wan_vae_loader
from omniloop.models.single_file import Resolve, SingleFileSet, text_encoder_sources
from omniloop.request import DiffusionParams, Modality, OmniRequest, TaskType

T2V_PIPELINE = "WanPipeline"
I2V_PIPELINE = "WanImageToVideoPipeline"
V2V_PIPELINE = "WanVideoToVideoPipeline"  # the T2V weights; task v2v starts from the encoded video
VACE_PIPELINE = "WanVACEPipeline"  # control video / mask / reference images (vace.py)
ANIMATE_PIPELINE = "WanAnimatePipeline"  # reference image + pose / face videos (animate.py)
ANIMATE_VARIANT = "wan2.2-animate"
TI2V_VARIANT = "wan2.2-ti2v"  # expand_timesteps: Wan2.2 TI2V-5B


# -- component loaders ---------------------------------------------------------------


# the GEMMs FP8 quantization converts: attention projections and FFN of every block
BLOCK_GEMMS = r"^blocks\.\d+\.(self_attn|cross_attn|ffn)\."


def _load_transformer(sub: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        model = load_wan_dit(root / sub, device=options.device, dtype=options.dtype)
        return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)

    return load



_load_vae = wan_vae_loader()


def _load_text(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_umt5_encoder(
        root / "text_encoder", root / "tokenizer", device=options.device, dtype=options.dtype,
        max_sequence_length=WAN_DEFAULTS.max_sequence_length or 512,
    )


def _load_image_encoder(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_clip_vision_encoder(root / "image_encoder", root / "image_processor", device=options.device,
                                    dtype=options.dtype)


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return load_sampler_set(root / "scheduler")


# -- single files (a ComfyUI models folder) -----------------------------------------------

WAN_HEAD_DIM = 128  # every released Wan DiT (not in the file)
WAN_SHIFT = 3.0  # the Wan2.1/2.2 diffusers repos' UniPC flow shift (480p); a workflow's sampler overrides it
TI2V_SHIFT = 5.0  # Wan2.2-TI2V-5B-Diffusers' UniPC flow shift


def wan_single_files(files: SingleFileSet, resolve: Resolve,
                     options: LoadOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """Original-layout DiT file(s) and the Wan2.1 VAE file (or Wan2.2's, with the TI2V-5B DiT);
    UMT5 from a transformers folder or a single file (with a tokenizer folder).
    -> the model_index a diffusers folder of them would have, and the components."""
    if len(files.diffusion_models) > 2 or len(files.text_encoders) != 1:
        raise ValueError(f"Wan takes one DiT (or Wan2.2's two experts) and one text encoder (UMT5-XXL); got "
                         f"diffusion_models={list(files.diffusion_models)}, text_encoders={list(files.text_encoders)}")
    if (len(files.diffusion_models) == 2) != (files.boundary_ratio is not None):  # a checkpoint holds one DiT
        raise ValueError("Wan2.2's two experts need boundary_ratio (0.875 t2v, 0.9 i2v), and boundary_ratio needs "
                         "two diffusion_models; pass both or neither")

    def dit(path: Path) -> Any:
        model = load_wan_dit_single_file(path, device=options.device, dtype=options.dtype,
                                         attention_head_dim=files.attention_head_dim or WAN_HEAD_DIM)
        return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)

    paths = files.dit_paths(resolve)
    experts = [dit(path) for path in paths]
    config = experts[0].config
    image_encoder = _single_file_image_encoder(files, resolve, options, config.image_dim, paths[0].name)
    text = text_encoder_sources(files, resolve)[0]
    load_text = load_umt5_encoder_single_file if text.single_file else load_umt5_encoder
    vae = load_wan_vae_single_file(files.vae_path(resolve), device=options.device, dtype=options.dtype)
    deploy_fused(vae, options)
    # the Wan2.2 VAE: its DiT is TI2V-5B's (checked at build), or a latent-concat DiT of its
    # width (Wan2.2 Fun InP 5B: 48 noise + 4 mask + 48 image channels in), an I2V pipeline
    ti2v = vae.config.is_residual and config.in_channels == config.out_channels
    if vae.config.is_residual and len(experts) != 1:
        raise ValueError("the Wan2.2 VAE (wan2.2_vae.safetensors) goes with Wan2.2 TI2V-5B, one DiT; got "
                         f"diffusion_models={list(files.diffusion_models)}: pass one, and no boundary_ratio")
    components: dict[str, Any] = {
        "transformer": experts[0],
        "vae": vae,
        "text_encoder": load_text(text.weights, text.tokenizer, device=options.device, dtype=options.dtype,
                                  max_sequence_length=WAN_DEFAULTS.max_sequence_length or 512),
        "sampler": flow_sampler_set("flow_unipc", shift=TI2V_SHIFT if vae.config.is_residual else WAN_SHIFT),
    }
    # latent-concat I2V DiTs take the noise and the image latents (16 + 20 channels; 48 + 52)
    vace = isinstance(experts[0], WanVaceDiT)  # a VACE file (ComfyUI's wan2.1_vace_*.safetensors)
    index: dict[str, Any] = {"_class_name": VACE_PIPELINE if vace else
                             I2V_PIPELINE if config.in_channels != config.out_channels else T2V_PIPELINE}
    if ti2v:
        index["expand_timesteps"] = True
    if image_encoder is not None:  # Wan2.1 I2V / FLF2V: what a diffusers folder's model_index lists
        components["image_encoder"] = image_encoder
        index.update(image_encoder=["transformers", "CLIPVisionModel"],
                     image_processor=["transformers", "CLIPImageProcessor"])
    if len(experts) == 2:
        components["transformer_2"] = experts[1]
        index.update(boundary_ratio=files.boundary_ratio,
                     transformer_2=["diffusers", "WanVACETransformer3DModel" if vace else "WanTransformer3DModel"])
    return index, components


def _single_file_image_encoder(files: SingleFileSet, resolve: Resolve, options: LoadOptions, image_dim: int | None,
                               dit_name: str) -> Any:
    """The CLIPVisionLoader file a Wan2.1 I2V / FLF2V DiT needs (None for other DiTs, which take none)."""
    if image_dim is None:
        if files.clip_vision:
            raise ValueError(f"clip_vision: {dit_name} takes no CLIP vision conditioning (no image embedder: a Wan2.1 "
                             f"T2V or Wan2.2 DiT); drop {files.clip_vision!r}, or load a Wan2.1 I2V DiT")
        return None
    if not files.clip_vision:
        raise ValueError(f"{dit_name} is a Wan2.1 I2V / FLF2V DiT (CLIP vision conditioning): load its image "
                         "encoder with a CLIPVisionLoader (clip_vision/clip_vision_h.safetensors)")
    encoder = load_clip_vision_single_file(resolve("clip_vision", files.clip_vision), device=options.device,
                                           dtype=options.dtype, num_attention_heads=files.clip_vision_heads)
    if encoder.hidden_size != image_dim:
        raise ValueError(f"clip_vision: {files.clip_vision!r} is {encoder.hidden_size} wide but {dit_name} takes "
                         f"{image_dim}-wide image tokens; pass the encoder it was trained with (ViT-H/14: 1280)")
    return encoder


# -- variants -------------------------------------------------------------------------


def _present(index: Mapping[str, Any], name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None


def wan_variant(index: Mapping[str, Any]) -> Variant:
    cls = index["_class_name"]
    if index.get("expand_timesteps"):
        return _ti2v_variant(index)
    if cls == VACE_PIPELINE:
        return _vace_variant(index)
    if cls == ANIMATE_PIPELINE:
        return _animate_variant(index)
    clip = cls == I2V_PIPELINE and _present(index, "image_encoder")
    if clip and not _present(index, "image_processor"):
        raise ValueError("model_index.json has an image_encoder but no image_processor; Wan2.1 I2V needs both "
                         "(CLIPVisionModel and CLIPImageProcessor folders)")
    two_experts = _present(index, "transformer_2") or index.get("boundary_ratio") is not None
    if two_experts and index.get("boundary_ratio") is None:
        raise ValueError("model_index.json has transformer_2 but no boundary_ratio; set boundary_ratio (e.g. 0.875)")
    tasks = frozenset({TaskType.I2V}) if cls == I2V_PIPELINE else frozenset({TaskType.T2V, TaskType.T2I, TaskType.V2V})
    weights = _core_weights("WanDiT")
    if two_experts:
        weights.append(
            WeightSpec(component="transformer_2", kind="WanDiT (low-noise expert)", subfolder="transformer_2",
                       load=_load_transformer("transformer_2"))
        )
    if clip:
        weights.append(WeightSpec(component="image_encoder", kind="CLIPVisionModel + CLIPImageProcessor",
                                  subfolder=("image_encoder", "image_processor"), load=_load_image_encoder))
    generation = "wan2.2" if two_experts or (cls == I2V_PIPELINE and not clip) else "wan2.1"
    return Variant(name=f"{generation}-{'i2v' if cls == I2V_PIPELINE else 't2v'}", tasks=tasks, weights=tuple(weights))


def _core_weights(dit_kind: str, vae_kind: str = "WanVAE") -> list[WeightSpec]:
    """Every Wan variant's transformer, VAE, UMT5 and scheduler."""
    return [
        WeightSpec(component="transformer", kind=dit_kind, subfolder="transformer", load=_load_transformer("transformer")),
        WeightSpec(component="vae", kind=vae_kind, subfolder="vae", load=_load_vae),
        WeightSpec(component="text_encoder", kind="UMT5 encoder + tokenizer", subfolder=("text_encoder", "tokenizer"), load=_load_text),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    ]


def _ti2v_variant(index: Mapping[str, Any]) -> Variant:
    """Wan2.2 TI2V-5B (``expand_timesteps``): one DiT for text- and image-to-video."""
    if _present(index, "transformer_2") or index.get("boundary_ratio") is not None:
        raise ValueError("model_index.json sets expand_timesteps (Wan2.2 TI2V-5B, one DiT) and transformer_2 / "
                         "boundary_ratio (two experts); TI2V has one transformer: drop transformer_2 and boundary_ratio")
    if _present(index, "image_encoder"):
        raise ValueError("model_index.json sets expand_timesteps (Wan2.2 TI2V-5B) and an image_encoder; TI2V "
                         "conditions on the first frame's VAE latents: drop image_encoder")
    weights = tuple(_core_weights("WanDiT", "WanVAE (Wan2.2)"))
    # ti2v: the image is optional (one model for both; TaskType.TI2V)
    tasks = frozenset({TaskType.T2V, TaskType.I2V, TaskType.TI2V, TaskType.T2I})
    return Variant(name=TI2V_VARIANT, tasks=tasks, weights=weights)


def _vace_variant(index: Mapping[str, Any]) -> Variant:
    """Wan VACE (``WanVACEPipeline``): text-to-video, and control-video-to-video with an
    optional mask, both with optional reference images; one DiT or Wan2.2's two experts."""
    if _present(index, "image_encoder"):
        raise ValueError("model_index.json names WanVACEPipeline and an image_encoder; VACE conditions on VAE "
                         "latents of the control video and reference images: drop image_encoder")
    two_experts = _present(index, "transformer_2") or index.get("boundary_ratio") is not None
    if two_experts and index.get("boundary_ratio") is None:
        raise ValueError("model_index.json has transformer_2 but no boundary_ratio; set boundary_ratio (e.g. 0.875)")
    weights = _core_weights("WanVaceDiT")
    if two_experts:
        weights.append(WeightSpec(component="transformer_2", kind="WanVaceDiT (low-noise expert)",
                                  subfolder="transformer_2", load=_load_transformer("transformer_2")))
    return Variant(name=f"{'wan2.2' if two_experts else 'wan2.1'}-vace", tasks=frozenset({TaskType.T2V, TaskType.V2V}),
                   weights=tuple(weights))


def _animate_variant(index: Mapping[str, Any]) -> Variant:
    """Wan-Animate (``WanAnimatePipeline``): one DiT with CLIP image tokens; task v2v (a
    reference image moved by pose / face videos)."""
    if not (_present(index, "image_encoder") and _present(index, "image_processor")):
        raise ValueError("model_index.json names WanAnimatePipeline without an image_encoder / image_processor; "
                         "Wan-Animate needs both (the CLIP tokens of the reference image)")
    if _present(index, "transformer_2") or index.get("boundary_ratio") is not None:
        raise ValueError("model_index.json names WanAnimatePipeline with transformer_2 / boundary_ratio; Wan-Animate "
                         "has one transformer: drop them")
    weights = _core_weights("WanAnimateDiT") + [
        WeightSpec(component="image_encoder", kind="CLIPVisionModel + CLIPImageProcessor",
                   subfolder=("image_encoder", "image_processor"), load=_load_image_encoder)]
    return Variant(name=ANIMATE_VARIANT, tasks=frozenset({TaskType.V2V}), weights=tuple(weights))


def is_vace(variant: Variant) -> bool:
    return variant.name.endswith("-vace")


def check_vace_components(components: Mapping[str, Any], vace: bool) -> None:
    """A WanVACEPipeline folder holds VACE DiTs (``WanVACETransformer3DModel``), and no other
    Wan pipeline does."""
    for name in ("transformer", "transformer_2"):
        dit = components.get(name)
        if dit is not None and isinstance(dit, WanVaceDiT) != vace:
            raise ValueError(
                f"{name}/config.json describes a {'WanVACETransformer3DModel' if not vace else 'WanTransformer3DModel'}"
                f" but model_index.json names {'WanVACEPipeline' if vace else 'a non-VACE Wan pipeline'}; pass a "
                f"{'WanVACEPipeline folder with its VACE DiT' if not vace else 'VACE transformer'} (or fix _class_name)")


def check_ti2v_components(vae: Any, dit: Any) -> None:
    """A TI2V folder's VAE must be the Wan2.2 one its DiT was trained on (z_dim = the DiT's channels)."""
    if not (vae.config.z_dim == dit.config.in_channels == dit.config.out_channels):
        raise ValueError(
            f"the VAE's z_dim={vae.config.z_dim} (vae/config.json) does not match the transformer's in_channels="
            f"{dit.config.in_channels} / out_channels={dit.config.out_channels}; Wan2.2 TI2V needs the Wan2.2 VAE "
            "(z_dim 48, is_residual true, patch_size 2, its 48 latents_mean / latents_std) and its 48-channel DiT")


def check_concat_components(vae: Any, dit: Any) -> None:
    """A latent-concat I2V DiT (Wan2.1 / Wan2.2 I2V, Wan Fun InP) takes the noise, the 4 mask
    channels (one per frame the VAE folds into a latent frame) and the image latents:
    ``in_channels = out_channels + scale_factor_temporal + z_dim`` (36 = 16 + 4 + 16; the Fun
    InP 5B with the Wan2.2 VAE: 100 = 48 + 4 + 48)."""
    c = vae.config
    want = dit.config.out_channels + c.scale_factor_temporal + c.z_dim
    if dit.config.in_channels != want:
        raise ValueError(
            f"the transformer's in_channels={dit.config.in_channels} does not fit a latent-concat I2V with this VAE: "
            f"out_channels {dit.config.out_channels} + {c.scale_factor_temporal} mask + z_dim {c.z_dim} = {want}; "
            "pass the VAE the DiT was trained with (z_dim 16: the Wan2.1 VAE; 48: Wan2.2's)")


# -- pipeline -------------------------------------------------------------------------


def wan_pipeline_spec(variant: Variant, *, boundary_ratio: float | None, cfg_mode: CFGMode = "sequential",
                      decode_whole: bool | None = False) -> PipelineSpec:
    """``decode_whole``: see ``VAEDecode.whole`` (diffusers checkpoints keep diffusers' chunked decode)."""
    if variant.name == TI2V_VARIANT:
        return ti2v_pipeline_spec(variant, cfg_mode=cfg_mode, decode_whole=decode_whole)
    if is_vace(variant):
        return vace_pipeline_spec(variant, boundary_ratio=boundary_ratio, cfg_mode=cfg_mode, decode_whole=decode_whole)
    if variant.name == ANIMATE_VARIANT:
        return animate_pipeline_spec(variant, cfg_mode=cfg_mode, decode_whole=decode_whole)
    i2v = TaskType.I2V in variant.tasks
    clip = any(w.component == "image_encoder" for w in variant.weights)
    nodes = [Node("text_encode", TextEncode())]
    if i2v:
        nodes.append(Node("image_condition", WanImageCondition(), when=task_in(TaskType.I2V)))
    if clip:  # Wan2.1 I2V: CLIP tokens of the first (and last) frame
        nodes.append(Node(IMAGE_ENCODE_NODE, WanImageEncode(), when=task_in(TaskType.I2V)))
    if TaskType.V2V in variant.tasks:  # loops from given latents: an encoded video, or latents passed in
        nodes.append(Node("video_encode", WanVideoEncode(), when=task_in(TaskType.V2V)))
        nodes.append(Node("given_latents", GivenLatents(WanDenoiser()), when=LATENTS_GIVEN & ~task_in(TaskType.V2V)))
    nodes += [
        Node(
            "denoise",
            # (with an image encoder, the loop also reads its CLIP tokens: WanDenoiseLoop)
            (WanDenoiseLoop if clip else DenoiseLoop)(
                WanDenoiser(),
                cfg=ClassicCFG(mode=cfg_mode),
                routing=_routing(boundary_ratio),
                shift=FlowShift(),
                conditioning=LatentConcat() if i2v else NoConditioning(),
            ),
        ),
        _decode_node(decode_whole),
    ]
    return _wan_spec(variant, tuple(nodes))


def ti2v_pipeline_spec(variant: Variant, *, cfg_mode: CFGMode = "sequential",
                       decode_whole: bool | None = False) -> PipelineSpec:
    """Wan2.2 TI2V-5B: text-to-video, and image-to-video by first-frame replacement with
    per-token timesteps (``ti2v.py``), through one DiT."""
    denoise = DenoiseLoop(Ti2vDenoiser(), cfg=ClassicCFG(mode=cfg_mode), routing=SingleModel(), shift=FlowShift(),
                          conditioning=FirstFrameLatents())
    nodes = (
        Node("text_encode", TextEncode()),
        Node("image_condition", Ti2vImageCondition(),
             when=task_in(TaskType.I2V) | (task_in(TaskType.TI2V) & opt("first_frame image given", _has_first_frame))),
        Node("denoise", denoise),
        _decode_node(decode_whole),
    )
    return _wan_spec(variant, nodes)


def vace_pipeline_spec(variant: Variant, *, boundary_ratio: float | None, cfg_mode: CFGMode = "sequential",
                       decode_whole: bool | None = False) -> PipelineSpec:
    """Wan VACE: the control latents (of the control video, mask and reference images; zeros
    and an all-ones mask for text-to-video) condition every step through the DiT's control
    branch; the reference frames are dropped before decoding (``vace.py``)."""
    denoise = VaceDenoiseLoop(VaceDenoiser(), cfg=ClassicCFG(mode=cfg_mode), routing=_routing(boundary_ratio),
                              shift=FlowShift())
    nodes = (
        Node("text_encode", TextEncode()),
        Node("vace_condition", VaceCondition()),
        Node("denoise", denoise),
        _decode_node(decode_whole),
    )
    return _wan_spec(variant, nodes, control_inputs=frozenset({"mask", "reference"}))


def animate_pipeline_spec(variant: Variant, *, cfg_mode: CFGMode = "sequential",
                          decode_whole: bool | None = False) -> PipelineSpec:
    """Wan-Animate: the reference image's CLIP tokens, then the pose video in segments
    (``animate_rollout.py``: each segment a denoise loop over the reference frame and the
    segment's, conditioned on the previous segment's last decoded frames; the rollout decodes
    the segments itself, so the graph has no decode node). ``decode_whole``: unused (the
    segments decode as diffusers does, frame by frame)."""
    denoise = AnimateDenoiseLoop(AnimateDenoiser(), cfg=ClassicCFG(mode=cfg_mode), routing=SingleModel(),
                                 shift=FlowShift(), conditioning=LatentConcat())
    nodes = (
        Node("text_encode", TextEncode()),
        Node(IMAGE_ENCODE_NODE, AnimateImageEncode()),
        Node("denoise", AnimateRollout(denoise)),
    )
    return _wan_spec(variant, nodes, control_inputs=frozenset({"reference", "pose", "face", "mask"}),
                     outputs={"video": "video", "latents": "final_latents"})


def _routing(boundary_ratio: float | None) -> BoundaryTimestepRouting | SingleModel:
    """Wan2.2 A14B's two experts switch at ``boundary_ratio``; one DiT otherwise."""
    return BoundaryTimestepRouting(boundary_ratio) if boundary_ratio is not None else SingleModel()


def _decode_node(decode_whole: bool | None) -> Node:
    # outputs.modalities=["latent"] (trajectory rollouts, latent-space pipelines) skips the VAE;
    # a large video decodes as steps the scheduler interleaves (pipeline/loops/decode.py)
    return Node("decode", VideoDecodeLoop(WanDenoiser(), whole=decode_whole), when=opt("pixels wanted", _wants_pixels))


WAN_OUTPUTS = {"video": "video", "image": "image", "latents": "final_latents", "trajectory": "trajectory"}


def _wan_spec(variant: Variant, nodes: tuple[Node, ...], control_inputs: frozenset[str] = frozenset(),
              outputs: Mapping[str, str] = WAN_OUTPUTS) -> PipelineSpec:
    """Every Wan pipeline's spec: its variant's components and named outputs (the same but
    Wan-Animate's: a video and its latents)."""
    return PipelineSpec(
        name=variant.name, family="wan", tasks=variant.tasks, components=variant.component_specs(), nodes=nodes,
        outputs=dict(outputs), control_inputs=control_inputs,
    )


def _has_first_frame(request: OmniRequest) -> bool:
    return first_frame(request) is not None


def _wants_pixels(request: OmniRequest) -> bool:
    return request.outputs.wants(Modality.VIDEO) or request.outputs.wants(Modality.IMAGE)


def build_wan(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    boundary = index.get("boundary_ratio")
    image_dim = components["transformer"].config.image_dim
    if (image_dim is not None) != ("image_encoder" in components):
        raise ValueError("the transformer's image_dim and the image_encoder go together (Wan2.1 I2V: CLIP image "
                         f"tokens); got image_dim={image_dim} with{'out' * ('image_encoder' not in components)} an "
                         "image_encoder: pass a checkpoint that has both or neither")
    check_vace_components(components, is_vace(variant))
    animate = variant.name == ANIMATE_VARIANT
    if animate != isinstance(components["transformer"], WanAnimateDiT):
        raise ValueError("transformer/config.json and model_index.json disagree on Wan-Animate: a WanAnimatePipeline "
                         "folder holds a WanAnimateTransformer3DModel and no other Wan pipeline does; fix _class_name")
    spec = wan_pipeline_spec(variant, boundary_ratio=boundary, cfg_mode=options.cfg_mode)
    if animate:
        check_concat_components(components["vae"], components["transformer"])
        return _pipeline(spec, components, ANIMATE_DEFAULTS, options, animate=True)
    if is_vace(variant):
        vace = vace_validator(components["transformer"].config, components["vae"].config.scale_factor_temporal)
        return _pipeline(spec, components, WAN_DEFAULTS, options, vace, vace=True)
    if TaskType.I2V in variant.tasks and variant.name != TI2V_VARIANT:
        check_concat_components(components["vae"], components["transformer"])
    if variant.name == TI2V_VARIANT:
        check_ti2v_components(components["vae"], components["transformer"])
        return _pipeline(spec, components, TI2V_DEFAULTS, options)
    return _pipeline(spec, components, WAN_DEFAULTS, options)


def _pipeline(
    spec: PipelineSpec,
    components: Mapping[str, Any],
    model_defaults: GenerationDefaults,
    options: LoadOptions,
    wrap_validator: Callable[[Callable[[OmniRequest], OmniRequest]], Callable[[OmniRequest], OmniRequest]] | None = None,
    limits: ModelLimits | None = None,
    vace: bool = False,
    animate: bool = False,
) -> Pipeline:
    vae = components["vae"]
    dit = components["transformer"]
    caps = size_caps(vae.config, dit.config, limits or ModelLimits())
    # the largest size the model serves, its size and frame steps, for generic readers (server warmup)
    defaults = model_defaults.replace(**{name: value for name, (value, _) in caps.items()},
                                      size_multiple=vae.config.scale_factor_spatial * dit.config.patch_size[1],
                                      frames_per_latent=vae.config.scale_factor_temporal)
    if animate:
        validate = animate_validator(defaults, vae.config, dit.config, components["sampler"], caps)
    else:
        validate = make_validator(defaults, vae.config, dit.config, components["sampler"], caps, vace=vace)
    return Pipeline(
        spec=spec,
        components=components,
        device=options.device,
        dtype=options.dtype,
        defaults=defaults,
        validate_request=wrap_validator(validate) if wrap_validator else validate,
        # update_weights takes the checkpoint's transformer/*.safetensors names
        checkpoint_layouts={c: dit_state_dict_from_diffusers for c in ("transformer", "transformer_2") if c in components},
    )


# Measured on one H100 (Wan2.1-1.3B, 480x832x81, 50 steps, CFG 5; issue 34): defaults 67.4 s,
# compile + sdpa_cudnn + batched CFG 53.5 s (wan_step_h200.jsonl: the CFG step batched 1.038 s).
WAN_FAST_PATH = FastPath(attention_backends=("sdpa_cudnn", "sdpa"), cfg_mode="batched", compile=True)

WAN = register_model_spec(
    ModelSpec(
        family="wan",
        diffusers_classes=(T2V_PIPELINE, I2V_PIPELINE, V2V_PIPELINE, VACE_PIPELINE, ANIMATE_PIPELINE),
        variant=wan_variant,
        build=build_wan,
        description="Wan2.1 / Wan2.2 video DiT with the causal 3D VAE and UMT5 text encoder",
        extras={"parallel": WAN_PARALLEL},
        fast_path=WAN_FAST_PATH,
        single_files=wan_single_files,
    )
)


# -- our manifest layout (omniloop_model.json) -------------------------------------------

MANIFEST_CLASS = manifest_class_name("wan")
MANIFEST_VAES = {"WanVAE": wan_vae_loader}  # the manifest's vae kind -> make(subfolder) -> loader
TEXT_ENCODER_KINDS = ("minilm",)
# Generation defaults a manifest may set (WAN_DEFAULTS keys, plus a student's fixed sigmas).
MANIFEST_DEFAULT_KEYS = frozenset({"steps", "guidance_scale", "guidance_scale_2", "height", "width", "num_frames",
                                   "fps", "negative_prompt", "max_sequence_length", "strength", "sigmas"})


def _manifest(index: Mapping[str, Any]) -> ModelManifest:
    return index["manifest"]


def _load_manifest_sampler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    entry = _manifest(index).components["sampler"]
    unknown = sorted(set(entry.config) - {"shift", "num_train_timesteps"})
    if unknown:
        raise ValueError(f"{root}: sampler config keys {unknown} are not supported; pass shift and num_train_timesteps")
    return flow_sampler_set(entry.kind, shift=float(entry.config.get("shift", 1.0)),
                            num_train_timesteps=int(entry.config.get("num_train_timesteps", 1000)))


def wan_manifest_variant(index: Mapping[str, Any]) -> Variant:
    m = _manifest(index)
    tasks = check_manifest(
        m, components={"transformer": True, "vae": True, "text_encoder": False, "sampler": False},
        kinds={"text_encoder": TEXT_ENCODER_KINDS}, default_keys=MANIFEST_DEFAULT_KEYS,
        tasks=frozenset({TaskType.T2V, TaskType.T2I}),
    )
    weights = manifest_weights(m, transformer_kind="WanDiT", load_transformer=_load_transformer,
                               vae_loaders=MANIFEST_VAES, load_sampler=_load_manifest_sampler,
                               max_sequence_length=WAN_DEFAULTS.max_sequence_length or 512)
    return Variant(name=m.variant, tasks=tasks, weights=weights)


def with_default_sigmas(sigmas: Sequence[float]):
    """Fill a request's sigmas with the model's (a distilled student's fixed grid) when it
    names neither steps nor sigmas, then run the family validator."""
    fixed = [float(s) for s in sigmas]

    def wrap(validate: Callable[[OmniRequest], OmniRequest]) -> Callable[[OmniRequest], OmniRequest]:
        def validate_with_sigmas(request: OmniRequest) -> OmniRequest:
            p = request.diffusion
            if p.sigmas is None and p.steps is None:
                request = request.model_copy(update={"diffusion": p.model_copy(update={"sigmas": fixed})})
            return validate(request)

        return validate_with_sigmas

    return wrap


def build_wan_manifest(
    variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions
) -> Pipeline:
    """A manifest Wan model: the Wan pipeline with the manifest's defaults. Also how training
    builds the real pipeline around its in-memory modules (``omniloop.train.recipes``)."""
    m = _manifest(index)
    defaults = m.generation_defaults(WAN_DEFAULTS)
    sigmas: list[float] | None = None if defaults.sigmas is None else list(defaults.sigmas)
    if sigmas is not None:
        sigmas = DiffusionParams(sigmas=sigmas).sigmas  # the request schema checks them
        assert sigmas is not None, "the schema keeps the sigmas it was given"
        # the student's grid reaches requests through the validator (with_default_sigmas), not the loops
        defaults = defaults.replace(steps=len(sigmas), sigmas=None)
    # our small models decode short clips as one chunk (5x faster on a CPU; see WanVAE.whole_fits)
    spec = wan_pipeline_spec(variant, boundary_ratio=None, cfg_mode=options.cfg_mode, decode_whole=None)
    return _pipeline(spec, components, defaults, options, with_default_sigmas(sigmas) if sigmas else None,
                     limits=m.limits)


WAN_MANIFEST = register_model_spec(
    ModelSpec(
        family="wan",
        diffusers_classes=(MANIFEST_CLASS,),
        variant=wan_manifest_variant,
        build=build_wan_manifest,
        description="Wan DiT + causal 3D VAE in omniloop's manifest layout, MiniLM text encoder (shapes-world models)",
        extras={"parallel": WAN_PARALLEL},
        fast_path=WAN_FAST_PATH,
    )
)


# TeaCache's view of the Wan DiT: the blocks run as WanBlock(x, context, context_image,
# modulation, rope), so the timestep-modulated input (e0) is the call's third argument.
TEACACHE = register_teacache_profile("wan", TeaCacheProfile(
    modulated_input=lambda call: call.args[2], polynomials=TEACACHE_POLYNOMIALS, default=TEACACHE_DEFAULT))
