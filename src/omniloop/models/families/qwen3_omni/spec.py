"""Qwen3-Omni ModelSpec: a transformers ``Qwen3OmniMoeForConditionalGeneration`` folder -> the
thinker -> talker -> code2wav graph.

Task REASON (a conversation or a prompt in, text out). With ``outputs.modalities`` naming
``audio`` the spoken answer runs too; each node is its own loop or stage, scheduled step by
step and batched with other requests' steps like any loop of the engine:

    chat      ChatPrompt (the tokenizer's chat template)  -> prompt_tokens
    thinker   ThinkerLoop (paged KV, MoE thinker)          -> text; streams thinker_hidden
    talker    TalkerLoop (paged KV, MoE talker; its forward  -> codec (frames of `groups` codes);
              runs the code predictor per frame)                streams codec_stream [speech]
    code2wav  Code2WavDecode (causal codec decoder)         -> audio (24 kHz)  [speech, not streamed]
    code2wav  Code2WavStream (the same, window by window)   -> audio deltas    [speech, outputs.stream]

The edges ``thinker_hidden`` (thinker -> talker) and ``codec_stream`` (talker -> code2wav) stream
(:data:`STREAM_EDGES`): the talker starts at the thinker's first generated position, the streamed
code2wav at the talker's first frames.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.families.qwen3_omni.chat_prompt import Omni3ChatPrompt
from omniloop.models.families.qwen3_omni.vision import load_vision_tower
from omniloop.models.families.qwen3_omni.presets import TALKER_SAMPLING, THINKER_DEFAULTS
from omniloop.models.families.qwen3_omni.stages import Code2WavDecode, Code2WavStream, TalkerLoop
from omniloop.models.omni.talker import CodecVocab
from omniloop.models.omni.thinker import ThinkerLoop, streams_speech, wants_speech
from omniloop.models.families.qwen3_omni.code2wav import SAMPLE_RATE
from omniloop.models.families.qwen3_omni.validate import make_omni3_validator
from omniloop.models.families.qwen3_omni.weights import (
    ARCHITECTURE, Omni3Config, load_audio_tower, load_code2wav, load_talker, load_thinker, read_config,
)
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.load_options import apply_load_options, graph_runner
from omniloop.models.omni.admission import ThinkerEncoders
from omniloop.models.omni.decoder_config import kv_pools
from omniloop.models.omni.checkpoint_folder import (
    load_feature_extractor, load_generation, load_image_processor, load_tokenizer,
)
from omniloop.models.omni.video_prompt import load_video_processing
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.pipeline.defaults import GenerationDefaults, TextDefaults
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.stages import is_chat
from omniloop.pipeline.streams import StreamEdge
from omniloop.request import Modality, TaskType

# The edges that stream: thinker -> talker (one chunk per thinker step; its capacity never holds
# the text back), talker -> code2wav (a streamed answer: the talker may run 64 frame chunks ahead)
STREAM_EDGES: tuple[StreamEdge, ...] = (StreamEdge("thinker_hidden", capacity=1 << 20),
                                        StreamEdge("codec_stream", capacity=64))


def _config(index: Mapping[str, Any]) -> Omni3Config:
    return Omni3Config.from_hf(dict(index.get("config", {})))


def _load_thinker(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_thinker(root, _config(index), device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.model.layers, fp8_layers=r"^model\.layers\.")


def _load_talker(root: Path, index: Mapping[str, Any], options: LoadOptions):
    config = _config(index)
    if not config.speaks:
        return None
    model = load_talker(root, config, device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.model.layers, fp8_layers=r"^model\.layers\.")


def _load_code2wav(root: Path, index: Mapping[str, Any], options: LoadOptions):
    config = _config(index)
    return load_code2wav(root, config, device=options.device) if config.speaks else None


def _load_video_processing(root: Path, index: Mapping[str, Any], options: LoadOptions):
    """``Qwen3OmniMoeProcessor``'s video preprocessing: its frame bounds (128 / 768 cells of 32 x 32
    pixels) and its fps default, 1 (``video_second_per_grid = temporal_patch_size / 1``: the
    released usage passes none); None without a vision preprocessing config (videos refused)."""
    return load_video_processing(root, min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, grid_fps=1.0)


def _load_audio_tower(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_audio_tower(root, _config(index), device=options.device, dtype=options.dtype)


def _load_vision_tower(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_vision_tower(root, device=options.device, dtype=options.dtype)


def omni3_variant(index: Mapping[str, Any]) -> Variant:
    config = _config(index)  # unsupported options fail before any read
    weights = (
        WeightSpec(component="thinker", kind="Qwen3-Omni MoE thinker", subfolder=".", load=_load_thinker),
        WeightSpec(component="tokenizer", kind="tokenizer", subfolder=".", load=load_tokenizer),
        WeightSpec(component="talker", kind="Qwen3-Omni MoE talker + code predictor", subfolder=".", load=_load_talker,
                   optional=True),
        WeightSpec(component="code2wav", kind="Qwen3-Omni code2wav", subfolder=".", load=_load_code2wav, optional=True),
        WeightSpec(component="audio_tower", kind="Qwen3-Omni audio encoder", subfolder=".", load=_load_audio_tower,
                   optional=True),
        WeightSpec(component="feature_extractor", kind="WhisperFeatureExtractor", subfolder=".",
                   load=load_feature_extractor, optional=True),
        WeightSpec(component="vision_tower", kind="Qwen3-Omni ViT (transformers' Qwen3OmniMoeVisionEncoder)",
                   subfolder=".", load=_load_vision_tower, optional=True),
        WeightSpec(component="image_processor", kind="Qwen2VLImageProcessor", subfolder=".", load=load_image_processor,
                   optional=True),
        WeightSpec(component="video_processing", kind="Qwen2VLVideoProcessor preprocessing", subfolder=".",
                   load=_load_video_processing, optional=True),
        WeightSpec(component="generation", kind="generation defaults", subfolder=".", load=load_generation,
                   optional=True),
    )
    c = config.thinker
    size = f"{c.num_hidden_layers}L-{c.hidden_size}d-{c.num_experts}e"
    return Variant(name=f"qwen3-omni-{size}", tasks=frozenset({TaskType.REASON}), weights=weights)


def omni3_pipeline_spec(variant: Variant, talker_text: TextDefaults | None = None, audio_token_id: int = -1,
                        image_token_id: int = -1, position_id_per_seconds: int = 25, video_token_id: int = -1,
                        soundtrack_frame: tuple[int, int] = (-1, -1),
                        graphs: CudaGraphRunner | None = None) -> PipelineSpec:
    """``graphs``: the thinker's and talker's decode forwards replay CUDA graphs (``cuda_graphs=True``).
    ``talker_text``: the talker node's own loop defaults (its stop code, transformers' talker
    sampling); ``audio_token_id`` / ``image_token_id`` / ``video_token_id``: the checkpoint's
    placeholders; ``soundtrack_frame``: its ``<|audio_start|>`` / ``<|audio_end|>`` (around a
    video's soundtrack)."""
    components = variant.component_specs()
    for name, kind in (("thinker_kv", "paged text-KV pool of the thinker (built)"),
                       ("talker_kv", "paged KV pool of the talker (built)"),
                       ("codec_vocab", "the talker's codec vocabulary (built)")):
        components[name] = ComponentSpec(name=name, kind=kind)
    speech = opt("speech wanted (outputs.modalities names audio)", wants_speech)
    streamed = opt("speech streamed (outputs.stream)", streams_speech)
    return PipelineSpec(
        name=variant.name,
        family="qwen3_omni",
        tasks=variant.tasks,
        components=components,
        nodes=(
            Node("chat", Omni3ChatPrompt(audio_token_id=audio_token_id, image_token_id=image_token_id,
                                         video_token_id=video_token_id, audio_start_token_id=soundtrack_frame[0],
                                         audio_end_token_id=soundtrack_frame[1],
                                         position_id_per_seconds=position_id_per_seconds),
                 when=opt("a conversation (text parts with roles)", is_chat)),
            Node("thinker", ThinkerLoop(lm_component="thinker", tokenizer_component="tokenizer",
                                        kv_component="thinker_kv", graphs=graphs)),
            Node("talker", TalkerLoop(lm_component="talker", tokenizer_component="codec_vocab", kv_component="talker_kv",
                                      graphs=graphs),
                 when=speech, defaults={} if talker_text is None else {"text": talker_text}),
            Node("code2wav", Code2WavDecode(), when=speech & ~streamed),
            Node("code2wav_stream", Code2WavStream(), when=streamed),
        ),
        outputs={"text": "text", "audio": "audio"},
        streams=STREAM_EDGES,
        conversation_media=frozenset({Modality.AUDIO, Modality.IMAGE, Modality.VIDEO}),
    )


def audio_end_id(tokenizer: Any) -> int:
    """``<|audio_end|>`` (the processor's ``audio_eos_token``; the config names no id for it), -1
    when the tokenizer lacks it (then no video is read with its soundtrack: its ids would be wrong)."""
    token = getattr(tokenizer, "audio_eos_token", None) or "<|audio_end|>"
    found = tokenizer.convert_tokens_to_ids(token)
    return -1 if found is None or found == tokenizer.unk_token_id else int(found)


def build_omni3(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    config = _config(index)
    thinker_text = dataclasses.replace(THINKER_DEFAULTS, eos_token_ids=config.eos_token_ids,
                                       max_context=config.thinker.max_position_embeddings,
                                       sampling=components.get("generation") or {"temperature": 0.0})
    decoders = {"thinker_kv": config.thinker, **({"talker_kv": config.talker} if config.talker is not None else {})}
    pools = kv_pools(decoders, options, block_size=THINKER_DEFAULTS.kv_block_tokens)
    talker_text = None
    if config.talker is not None and config.tokens is not None:
        frames = options.max_audio_tokens or int(TALKER_SAMPLING["max_tokens"])
        talker_text = TextDefaults(eos_token_ids=(config.tokens.codec_eos,),
                                   sampling={**TALKER_SAMPLING, "max_tokens": frames},
                                   max_context=config.talker.max_position_embeddings,
                                   prefill_chunk_tokens=THINKER_DEFAULTS.prefill_chunk_tokens)
    components = {**components, **pools, "codec_vocab": CodecVocab()}
    graphs = graph_runner(options)  # refused off CUDA
    return Pipeline(
        spec=omni3_pipeline_spec(variant, talker_text, audio_token_id=config.audio_token_id,
                                 image_token_id=config.image_token_id,
                                 position_id_per_seconds=config.position_id_per_seconds,
                                 video_token_id=config.video_token_id,
                                 soundtrack_frame=(config.audio_start_token_id, audio_end_id(components["tokenizer"])),
                                 graphs=graphs),
        components=components, device=options.device, dtype=options.dtype,
        caches={GRAPHS: graphs} if graphs is not None else {},
        defaults=GenerationDefaults(sample_rate=SAMPLE_RATE, text=thinker_text),
        validate_request=make_omni3_validator(components["tokenizer"], config, pool=pools["thinker_kv"],
                                              encoders=ThinkerEncoders.of(components)),
    )


QWEN3_OMNI = register_model_spec(
    ModelSpec(
        family="qwen3_omni",
        diffusers_classes=(ARCHITECTURE,),  # transformers folders: config.json architectures[0]
        variant=omni3_variant,
        build=build_omni3,
        description="Qwen3-Omni: MoE thinker (text AR loop) -> MoE talker + code predictor (speech-frame AR loop) "
                    "-> code2wav (causal codec decoder)",
    )
)

__all__ = ["QWEN3_OMNI", "STREAM_EDGES", "read_config"]
