"""Random-weight Stable Audio Open and LTX-2 pipelines for benchmarks, each as the diffusers
pipeline and ours over the same weights, built in memory (no checkpoint on disk: LTX-2's 19B
transformer would take longer to save and read back than to benchmark).

``size="published"``: the released architectures - Stable Audio Open 1.0 (24-block DiT,
Oobleck VAE at 44.1 kHz, T5-base) and LTX-2.0 (48-block joint video + audio DiT, video and
audio VAEs, vocoder, connectors) - with one change: LTX-2's Gemma 3 text encoder keeps its
real width (3840) but one decoder layer, not 48 (its cost is not what these figures measure;
the connectors then read 2 layers' states, not 49). ``size="tiny"``: CPU smoke sizes.

Our components come from the diffusers modules through the families' own key maps
(``from_diffusers_module``); LTX-2's share the diffusers tensors, so both pipelines fit on one
GPU. Random deep stacks are kept finite in bf16 by shrinking output projections, as trained
models have small ones.
"""

from __future__ import annotations

import functools

import torch
from common import built_in  # benchmarks/ is on sys.path: the benches import this file

from omniloop.models.families.ltx2 import presets as LP
from omniloop.models.families.ltx2 import weights as LW
from omniloop.models.families.ltx2.spec import BLOCK_GEMMS as LTX2_GEMMS
from omniloop.models.families.ltx2.spec import build_ltx2, ltx2_variant
from omniloop.models.families.stable_audio import presets as SP
from omniloop.models.families.stable_audio import weights as SW
from omniloop.models.families.stable_audio.spec import BLOCK_GEMMS as SA_GEMMS
from omniloop.models.families.stable_audio.spec import build_stable_audio, stable_audio_variant
from omniloop.models.load_options import apply_load_options
from omniloop.models.model_spec import LoadOptions
from omniloop.models.text.gemma import GemmaLayerStates
from omniloop.models.text.t5 import MaskedT5TextEncoder
from omniloop.pipeline.samplers import build_sampler, sampler_for_diffusers_class
from omniloop.pipeline.samplers.sampler_set import SamplerSet

SIZES = ("published", "tiny")
CORPUS = ["a dog barking in the rain", "waves crash on a beach at sunset", "a piano melody in a quiet room",
          "a car drives by on a wet street", "low quality, noise, worst quality, blurry", "birds sing at dawn"]
OUTPUT_LAYERS = ("to_out.0.weight", "to_out.weight", "proj_out.weight", "ff.net.2.weight", "audio_ff.net.2.weight")


def _shrink_outputs(module: torch.nn.Module, factor: float = 0.1) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(OUTPUT_LAYERS):
                p.mul_(factor)


@functools.cache  # one per process: training breaks ties in hash order (flux_random._tokenizers)
def _t5_tokenizer(max_length: int):
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(CORPUS * 20, vocab_size=80, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    return T5TokenizerFast(tokenizer_object=sp._tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=max_length)


@functools.cache
def _gemma_tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=96, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    return GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                              unk_token="<unk>", model_max_length=max_length, padding_side="left")


# -- Stable Audio Open --------------------------------------------------------------------

def _sa_configs(size: str):
    if size == "published":  # T5-base: stable-audio-open-1.0's text encoder, 128 tokens
        t5 = dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, relative_attention_num_buckets=32)
        return dict(SP.SAO_TRANSFORMER), dict(SP.SAO_VAE), dict(SP.SAO_PROJECTION), t5, 128
    dit = dict(SP.SAO_TRANSFORMER, sample_size=32, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
               num_attention_heads=4, num_key_value_attention_heads=2, cross_attention_dim=16, time_proj_dim=8,
               global_states_input_dim=32, cross_attention_input_dim=16)
    vae = dict(SP.SAO_VAE, encoder_hidden_size=8, downsampling_ratios=[2, 4], channel_multiples=[1, 2],
               decoder_channels=6, decoder_input_channels=4, sampling_rate=128)
    t5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    return dit, vae, dict(SP.SAO_PROJECTION, text_encoder_dim=32, conditioning_dim=16, max_value=4), t5, 12


def random_stable_audio(size: str, options: LoadOptions):
    """(diffusers StableAudioPipeline, our Pipeline) over the same random weights."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel, StableAudioPipeline
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    dit_cfg, vae_cfg, proj_cfg, t5_cfg, tokens = _sa_configs(size)
    dev, dtype = options.device, options.dtype
    tokenizer = _t5_tokenizer(tokens)
    torch.manual_seed(0)
    t5 = built_in(dev, dtype, lambda: T5EncoderModel(T5Config(vocab_size=len(tokenizer), dropout_rate=0.0, **t5_cfg)))
    dit = built_in(dev, dtype, lambda: StableAudioDiTModel(**dit_cfg))
    _shrink_outputs(dit)
    vae = built_in(dev, dtype, lambda: AutoencoderOobleck(**vae_cfg))
    projection = built_in(dev, dtype, lambda: StableAudioProjectionModel(**proj_cfg))
    scheduler = CosineDPMSolverMultistepScheduler(**SP.SAO_SCHEDULER)
    ref = StableAudioPipeline(vae=vae, text_encoder=t5, projection_model=projection, tokenizer=tokenizer,
                              transformer=dit, scheduler=scheduler)
    ours_dit = SW.from_diffusers_module("transformer", dit, dtype)
    name = sampler_for_diffusers_class("CosineDPMSolverMultistepScheduler")
    components = {
        "transformer": apply_load_options(ours_dit, options, blocks=ours_dit.blocks, fp8_layers=SA_GEMMS),
        "vae": SW.from_diffusers_module("vae", vae, dtype),
        "projection_model": SW.from_diffusers_module("projection_model", projection, dtype),
        "text_encoder": MaskedT5TextEncoder(t5, tokenizer),
        "sampler": SamplerSet.single(name, build_sampler(name, dict(scheduler.config))),
    }
    return ref, build_stable_audio(stable_audio_variant({}), {}, components, options)


# -- LTX-2 ----------------------------------------------------------------------------------

def _ltx2_configs(size: str):
    if size == "published":
        gemma = dict(LP.GEMMA3_12B_TEXT, num_hidden_layers=1)
        return (dict(LP.LTX2_TRANSFORMER), dict(LP.LTX2_CONNECTORS, text_proj_in_factor=2), dict(LP.LTX2_VIDEO_VAE),
                dict(LP.LTX2_AUDIO_VAE), dict(LP.LTX2_VOCODER), gemma, 1024)
    gemma = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8)
    dit = dict(LP.LTX2_TRANSFORMER, in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
               cross_attention_dim=16, audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=2,
               audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2, caption_channels=16)
    connectors = dict(LP.LTX2_CONNECTORS, caption_channels=16, text_proj_in_factor=3,
                      video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
                      video_connector_num_layers=1, video_connector_num_learnable_registers=4,
                      audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
                      audio_connector_num_layers=1, audio_connector_num_learnable_registers=4)
    vae = dict(LP.LTX2_VIDEO_VAE, latent_channels=8, block_out_channels=(16, 32, 64, 64),
               decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
               decoder_layers_per_block=(1, 1, 1, 1))
    audio_vae = dict(LP.LTX2_AUDIO_VAE, base_channels=16, num_res_blocks=1, latent_channels=4, mel_bins=16,
                     resolution=32)
    vocoder = dict(LP.LTX2_VOCODER, in_channels=32, hidden_channels=32, upsample_kernel_sizes=[10, 8, 8],
                   upsample_factors=[5, 4, 4], resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3], [1, 3]],
                   output_sampling_rate=8000)
    return dit, connectors, vae, audio_vae, vocoder, gemma, 16


def _gemma(vocab: int, text: dict):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text_cfg = Gemma3TextConfig(vocab_size=vocab, max_position_embeddings=2048, sliding_window=1024, **text)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)  # unused by text encoding; the class needs one
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text_cfg, vision_config=vision, mm_tokens_per_image=4))


def random_ltx2(size: str, options: LoadOptions):
    """(diffusers LTX2Pipeline, our Pipeline) over the same random weights (shared tensors)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    dit_cfg, conn_cfg, vae_cfg, audio_cfg, voc_cfg, gemma_cfg, tokens = _ltx2_configs(size)
    dev, dtype = options.device, options.dtype
    tokenizer = _gemma_tokenizer(tokens)
    torch.manual_seed(0)
    gemma = built_in(dev, dtype, lambda: _gemma(len(tokenizer), gemma_cfg))
    dit = built_in(dev, dtype, lambda: LTX2VideoTransformer3DModel(**dit_cfg))
    _shrink_outputs(dit)
    connectors = built_in(dev, dtype, lambda: LTX2TextConnectors(**conn_cfg))
    vae = built_in(dev, dtype, lambda: AutoencoderKLLTX2Video(**vae_cfg))
    audio_vae = built_in(dev, dtype, lambda: AutoencoderKLLTX2Audio(**audio_cfg))
    vocoder = built_in(dev, dtype, lambda: LTX2Vocoder(**voc_cfg))
    scheduler = FlowMatchEulerDiscreteScheduler(**LP.LTX2_SCHEDULER)
    ref = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=gemma, tokenizer=tokenizer,
                       connectors=connectors, transformer=dit, vocoder=vocoder)
    ours_dit = LW.from_diffusers_module("transformer", dit)
    config = dict(scheduler.config)
    components = {
        "transformer": apply_load_options(ours_dit, options, blocks=ours_dit.blocks, fp8_layers=LTX2_GEMMS),
        "connectors": LW.from_diffusers_module("connectors", connectors),
        "vae": LW.from_diffusers_module("vae", vae),
        "audio_vae": LW.from_diffusers_module("audio_vae", audio_vae),
        "vocoder": LW.from_diffusers_module("vocoder", vocoder),
        "text_encoder": GemmaLayerStates(gemma, tokenizer, max_sequence_length=tokens),
        "sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler", config)),
        "refine_sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler",
                                                                        {**config, **LP.REFINE_SCHEDULER_OVERRIDES})),
    }
    return ref, build_ltx2(ltx2_variant({}), {}, components, options)

