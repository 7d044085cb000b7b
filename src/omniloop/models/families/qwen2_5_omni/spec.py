"""Qwen2.5-Omni ModelSpec: a transformers ``Qwen2_5OmniForConditionalGeneration`` folder -> the
thinker -> talker -> token2wav -> vocoder graph.

Task REASON (a conversation or a prompt in, text out; a conversation may carry audio,
image and video parts, which the thinker's encoders read: ``chat_prompt.py``). With ``outputs.modalities`` naming
``audio`` the spoken answer runs too: each node is its own loop, scheduled step by step and
batched with other requests' steps like any loop of the engine:

    chat (conversation -> prompt ids; audio / image / video parts -> embeddings at their placeholders)
    thinker   ARDecodeLoop (paged KV)     -> text, thinker_states
    talker    ARDecodeLoop (paged KV)     -> codec           [speech only]
    token2wav DenoiseLoop (DiT, rk4_flow) -> latents (mel)    [speech, not streamed]
    vocoder   SpeechDecode (BigVGAN)      -> audio (24 kHz)   [speech, not streamed]
    code2wav  Code2WavLoop (windows)      -> audio deltas     [speech, outputs.stream]

The edges ``thinker_hidden`` (thinker -> talker) and ``codec_stream`` (talker -> code2wav)
stream (:data:`STREAM_EDGES`): the talker starts at the thinker's first generated position,
code2wav at the talker's first codes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.families.qwen2_5_omni.chat_prompt import OmniChatPrompt
from omniloop.models.families.qwen2_5_omni.presets import (
    TALKER_SAMPLING, THINKER_DEFAULTS, TOKEN2WAV_GUIDANCE, TOKEN2WAV_STEPS, TOKEN2WAV_SWAY,
)
from omniloop.models.families.qwen2_5_omni.stages import (
    BigVGANDecoder, Code2WavLoop, SpeechDecode, TalkerLoop, ThinkerLoop, Token2WavDenoiser, Token2WavLoop,
    streams_speech, wants_speech,
)
from omniloop.models.families.qwen2_5_omni.validate import make_omni_validator
from omniloop.models.omni.video_prompt import load_video_processing
from omniloop.models.families.qwen2_5_omni.weights import (
    ARCHITECTURE, OmniConfig, load_audio_tower, load_bigvgan, load_dit, load_speakers, load_talker, load_thinker,
    load_vision_tower, read_config,
)
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.load_options import apply_load_options, graph_runner
from omniloop.models.omni.admission import ThinkerEncoders
from omniloop.models.omni.decoder_config import kv_pools
from omniloop.models.omni.checkpoint_folder import (
    load_feature_extractor, load_generation, load_image_processor, load_tokenizer,
)
from omniloop.models.omni.talker import CodecVocab
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.pipeline.defaults import GenerationDefaults, TextDefaults
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import EmbeddedGuidance
from omniloop.pipeline.policies.routing import SingleModel
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.samplers.rk4_flow import RK4FlowSampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.streams import StreamEdge
from omniloop.pipeline.stages import is_chat
from omniloop.request import Modality, TaskType

# The edges that stream (the downstream node starts at the upstream's first chunk): thinker ->
# talker. Its capacity never holds the thinker back (the text answer is not paced by the
# speech: the talker makes several codes per text token); one chunk is one [1, D] row.
# talker -> code2wav (a streamed spoken answer): the talker may run 64 codes ahead of the window
# being decoded (a window takes at most 3 + repeats + 1 blocks of codes: 48 for the 7B)
STREAM_EDGES: tuple[StreamEdge, ...] = (StreamEdge("thinker_hidden", capacity=1 << 20),
                                        StreamEdge("codec_stream", capacity=64))


def _config(root: Path, index: Mapping[str, Any]) -> OmniConfig:
    return OmniConfig.from_hf(dict(index.get("config", {})))


def _load_thinker(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_thinker(root, _config(root, index), device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.model.layers, fp8_layers=r"^model\.layers\.")


def _load_talker(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_talker(root, _config(root, index), device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.model.layers, fp8_layers=r"^model\.layers\.")


def _load_audio_tower(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_audio_tower(root, _config(root, index), device=options.device, dtype=options.dtype)


def _load_vision_tower(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_vision_tower(root, _config(root, index), device=options.device, dtype=options.dtype)


def _load_video_processing(root: Path, index: Mapping[str, Any], options: LoadOptions):
    """The processor's video preprocessing (``video_prompt.VideoProcessing``), or None: then
    videos are refused at admission."""
    return load_video_processing(root)


def _load_dit(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_dit(root, _config(root, index), device=options.device)


def _load_vocoder(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_bigvgan(root, _config(root, index), device=options.device)


def _load_speakers(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_speakers(root, device=options.device)


def omni_variant(index: Mapping[str, Any]) -> Variant:
    config = OmniConfig.from_hf(dict(index.get("config", {})))  # unsupported options fail before any read
    weights = (
        WeightSpec(component="thinker", kind="Qwen2.5-Omni thinker", subfolder=".", load=_load_thinker),
        WeightSpec(component="talker", kind="Qwen2.5-Omni talker", subfolder=".", load=_load_talker),
        WeightSpec(component="dit", kind="Qwen2.5-Omni token2wav DiT", subfolder=".", load=_load_dit),
        WeightSpec(component="vocoder", kind="Qwen2.5-Omni BigVGAN", subfolder=".", load=_load_vocoder),
        WeightSpec(component="speakers", kind="spk_dict.pt voices", subfolder=".", load=_load_speakers),
        WeightSpec(component="tokenizer", kind="tokenizer", subfolder=".", load=load_tokenizer),
        WeightSpec(component="audio_tower", kind="Qwen2.5-Omni audio encoder", subfolder=".", load=_load_audio_tower,
                   optional=True),
        WeightSpec(component="feature_extractor", kind="WhisperFeatureExtractor", subfolder=".",
                   load=load_feature_extractor, optional=True),
        WeightSpec(component="vision_tower", kind="Qwen2.5-Omni vision encoder", subfolder=".", load=_load_vision_tower,
                   optional=True),
        WeightSpec(component="image_processor", kind="Qwen2VLImageProcessor", subfolder=".",
                   load=load_image_processor, optional=True),
        WeightSpec(component="video_processing", kind="Qwen2VLVideoProcessor preprocessing", subfolder=".",
                   load=_load_video_processing, optional=True),
        WeightSpec(component="generation", kind="generation defaults", subfolder=".", load=load_generation,
                   optional=True),
    )
    size = f"{config.thinker.num_hidden_layers}L-{config.thinker.hidden_size}d"
    return Variant(name=f"qwen2.5-omni-{size}", tasks=frozenset({TaskType.REASON}), weights=weights)


def omni_pipeline_spec(variant: Variant, talker_text: TextDefaults | None = None, max_codes: int = 4096,
                       streams: tuple[StreamEdge, ...] = STREAM_EDGES, audio_token_id: int = -1,
                       image_token_id: int = -1, video_token_id: int = -1,
                       audio_frame: tuple[int, int] = (-1, -1), graphs: CudaGraphRunner | None = None) -> PipelineSpec:
    """``graphs``: the thinker's and talker's decode forwards replay CUDA graphs (``cuda_graphs=True``).
    ``talker_text``: the talker node's own loop defaults (its stop codes, transformers'
    talker sampling), over the pipeline's (the thinker's); ``audio_token_id``: the checkpoint's
    ``<|AUDIO|>`` / ``<|IMAGE|>`` / ``<|VIDEO|>`` placeholders; ``audio_frame``: its ``<|audio_bos|>``,
    ``<|audio_eos|>`` (around a video's soundtrack)."""
    components = variant.component_specs()
    for name, kind in (("thinker_kv", "paged text-KV pool of the thinker (built)"),
                       ("talker_kv", "paged KV pool of the talker (built)"),
                       ("codec_vocab", "the talker's codec vocabulary (built)"),
                       ("sampler", "token2wav's ODE solver (built)")):
        components[name] = ComponentSpec(name=name, kind=kind)
    speech = opt("speech wanted (outputs.modalities names audio)", wants_speech)
    streamed = opt("speech streamed (outputs.stream)", streams_speech)
    return PipelineSpec(
        name=variant.name,
        family="qwen2_5_omni",
        tasks=variant.tasks,
        components=components,
        nodes=(
            Node("chat", OmniChatPrompt(audio_token_id=audio_token_id, image_token_id=image_token_id,
                                        video_token_id=video_token_id, audio_start_token_id=audio_frame[0],
                                        audio_end_token_id=audio_frame[1]),
                 when=opt("a conversation (text parts with roles)", is_chat)),
            Node("thinker", ThinkerLoop(lm_component="thinker", tokenizer_component="tokenizer",
                                        kv_component="thinker_kv", graphs=graphs)),
            Node("talker", TalkerLoop(lm_component="talker", tokenizer_component="codec_vocab",
                                      kv_component="talker_kv", graphs=graphs), when=speech,
                 defaults={} if talker_text is None else {"text": talker_text}),
            Node("token2wav", Token2WavLoop(Token2WavDenoiser(max_codes=max_codes), cfg=EmbeddedGuidance(kwarg="guidance_scale"),
                                            routing=SingleModel("dit"), sampler_component="sampler"),
                 when=speech & ~streamed),
            Node("vocoder", SpeechDecode(decoder=BigVGANDecoder()), when=speech & ~streamed),
            Node("code2wav", Code2WavLoop(max_codes=max_codes), when=streamed),
        ),
        outputs={"text": "text", "audio": "audio"},
        streams=streams,
        conversation_media=frozenset({Modality.AUDIO, Modality.IMAGE, Modality.VIDEO}),
    )


def build_omni(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    config = OmniConfig.from_hf(dict(index.get("config", {})))
    thinker_text = dataclasses.replace(THINKER_DEFAULTS, eos_token_ids=config.eos_token_ids,
                                       max_context=config.thinker.max_position_embeddings,
                                       sampling=components.get("generation") or {"temperature": 0.0})
    # the speech's bound: the deployment's max_audio_tokens (default transformers' 4096 codes), at
    # most what token2wav decodes (its mel positions)
    wanted = options.max_audio_tokens or int(TALKER_SAMPLING["max_tokens"])
    max_codes = min(wanted, config.dit.max_position_embeddings // config.dit.repeats)
    talker_text = TextDefaults(eos_token_ids=(config.tokens.codec_pad, config.tokens.codec_eos),
                               sampling={**TALKER_SAMPLING, "max_tokens": max_codes}, max_context=config.talker.max_position_embeddings,
                               prefill_chunk_tokens=THINKER_DEFAULTS.prefill_chunk_tokens)
    pools = kv_pools({"thinker_kv": config.thinker, "talker_kv": config.talker}, options,
                     block_size=THINKER_DEFAULTS.kv_block_tokens)
    sampler = RK4FlowSampler.from_config({"sway_coefficient": TOKEN2WAV_SWAY})
    components = {**components, **pools, "codec_vocab": CodecVocab(), "sampler": SamplerSet.single(sampler.name, sampler)}
    defaults = GenerationDefaults(steps=TOKEN2WAV_STEPS, guidance_scale=TOKEN2WAV_GUIDANCE, sample_rate=24000,
                                  text=thinker_text)
    graphs = graph_runner(options)  # refused off CUDA
    return Pipeline(
        spec=omni_pipeline_spec(variant, talker_text, max_codes, audio_token_id=config.audio_token_id,
                                image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                                audio_frame=(config.audio_start_token_id, config.audio_end_token_id), graphs=graphs),
        components=components, device=options.device, dtype=options.dtype, defaults=defaults,
        caches={GRAPHS: graphs} if graphs is not None else {},
        validate_request=make_omni_validator(components["tokenizer"], config, pool=pools["thinker_kv"],
                                             encoders=ThinkerEncoders.of(components)),
    )


QWEN2_5_OMNI = register_model_spec(
    ModelSpec(
        family="qwen2_5_omni",
        diffusers_classes=(ARCHITECTURE,),  # transformers folders: config.json architectures[0]
        variant=omni_variant,
        build=build_omni,
        description="Qwen2.5-Omni: thinker (text AR loop) -> talker (codec AR loop) -> token2wav (DiT flow + RK4 "
                    "on the denoise loop) -> BigVGAN",
    )
)

__all__ = ["QWEN2_5_OMNI", "STREAM_EDGES", "read_config"]
