"""A tiny Stable Audio as ComfyUI users hold it: stable-audio-tools' one checkpoint
(``model.model.`` DiT, ``pretransform.model.`` Oobleck VAE, ``conditioner.conditioners.``
seconds embedders) made from tiny diffusers modules by the inverse of diffusers' conversion
script (tests/oracles/diffusers_convert_stable_audio.py), and the T5 as ComfyUI's
``t5_base.safetensors`` (a whole T5ForConditionalGeneration: encoder, decoder, LM head).
Written here from the script's forward map, independent of the loader under test."""

from __future__ import annotations

import re
from pathlib import Path

import torch

# the released facts the loader assumes (Stable Audio Open 1.0's model_config.json), kept by the tiny model
SAMPLE_RATE, SAMPLE_SIZE, SECONDS_MAX = 44100, 1024, 512
STRIDES = [2, 4, 8]  # hop 64: 1024 latent frames = 1.49 s at 44.1 kHz (EmptyLatentAudio's minimum is 1 s)
HEAD_DIM = 8


def make_sao_like_pipeline(tokenizer_dir: Path):
    """A tiny StableAudioPipeline with Open 1.0's layout facts: T5 width = conditioning width (no
    text projection, as t5-base 768 = 768), 44.1 kHz, 1024 latent frames, seconds in [0, 512]."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel, StableAudioPipeline
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    from tests.models.stable_audio.checkpoint import tiny_tokenizer

    tokenizer = tiny_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0)).eval()
    torch.manual_seed(1)
    transformer = StableAudioDiTModel(sample_size=SAMPLE_SIZE, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                                      num_attention_heads=4, num_key_value_attention_heads=2, out_channels=4,
                                      cross_attention_dim=16, time_proj_dim=8, global_states_input_dim=32,
                                      cross_attention_input_dim=16).eval()
    with torch.no_grad():  # LayerNorm biases are zero at init: make them count
        for name, p in transformer.named_parameters():
            if re.search(r"norm\d\.bias$", name):
                p.normal_(0, 0.1)
    torch.manual_seed(2)
    vae = AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=STRIDES, channel_multiples=[1, 2, 2],
                             decoder_channels=4, decoder_input_channels=4, audio_channels=2,
                             sampling_rate=SAMPLE_RATE).eval()
    torch.manual_seed(3)
    projection = StableAudioProjectionModel(text_encoder_dim=16, conditioning_dim=16, min_value=0,
                                            max_value=SECONDS_MAX).eval()
    scheduler = CosineDPMSolverMultistepScheduler(sigma_min=0.3, sigma_max=500, sigma_data=1.0,
                                                  sigma_schedule="exponential", solver_order=2,
                                                  prediction_type="v_prediction", final_sigmas_type="zero")
    return StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection, tokenizer=tokenizer,
                               transformer=transformer, scheduler=scheduler)


def _c(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous()


_DIT = (
    (r"^timestep_proj\.", "to_timestep_embed."), (r"^global_proj\.", "to_global_embed."),
    (r"^cross_attention_proj\.", "to_cond_embed."), (r"^proj_in\.", "transformer.project_in."),
    (r"^proj_out\.", "transformer.project_out."),
    (r"^transformer_blocks\.(\d+)\.norm1\.weight$", r"transformer.layers.\1.pre_norm.gamma"),
    (r"^transformer_blocks\.(\d+)\.norm1\.bias$", r"transformer.layers.\1.pre_norm.beta"),
    (r"^transformer_blocks\.(\d+)\.norm2\.weight$", r"transformer.layers.\1.cross_attend_norm.gamma"),
    (r"^transformer_blocks\.(\d+)\.norm2\.bias$", r"transformer.layers.\1.cross_attend_norm.beta"),
    (r"^transformer_blocks\.(\d+)\.norm3\.weight$", r"transformer.layers.\1.ff_norm.gamma"),
    (r"^transformer_blocks\.(\d+)\.norm3\.bias$", r"transformer.layers.\1.ff_norm.beta"),
    (r"^transformer_blocks\.(\d+)\.attn1\.to_out\.0\.", r"transformer.layers.\1.self_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn2\.to_out\.0\.", r"transformer.layers.\1.cross_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn2\.to_q\.", r"transformer.layers.\1.cross_attn.to_q."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.", r"transformer.layers.\1.ff.ff.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"transformer.layers.\1.ff.ff.2."),
)


def _rename(key: str, table) -> str:
    for pattern, repl in table:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    return key


def dit_original(sd: dict[str, torch.Tensor], head_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """diffusers StableAudioDiTModel -> stable-audio-tools' DiffusionTransformer keys (q, k, v
    fused into to_qkv, k, v into to_kv; LayerNorm gamma / beta; Fourier weight [F, 1]; and the
    rotary table it stores, of max(head_dim / 2, 32) / 2 frequencies)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if m := re.match(r"^transformer_blocks\.(\d+)\.attn1\.to_([qkv])\.weight$", key):
            if m[2] == "q":
                parts = [sd[f"transformer_blocks.{m[1]}.attn1.to_{x}.weight"] for x in "qkv"]
                out[f"transformer.layers.{m[1]}.self_attn.to_qkv.weight"] = _c(torch.cat(parts))
        elif m := re.match(r"^transformer_blocks\.(\d+)\.attn2\.to_([kv])\.weight$", key):
            if m[2] == "k":
                parts = [sd[f"transformer_blocks.{m[1]}.attn2.to_{x}.weight"] for x in "kv"]
                out[f"transformer.layers.{m[1]}.cross_attn.to_kv.weight"] = _c(torch.cat(parts))
        elif key == "time_proj.weight":
            out["timestep_features.weight"] = _c(t[:, None])
        else:
            out[_rename(key, _DIT)] = _c(t)
    rotary = max(head_dim // 2, 32)
    out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / rotary)
    return out


def vae_original(sd: dict[str, torch.Tensor], blocks: int = len(STRIDES)) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderOobleck -> stable-audio-tools' Oobleck keys (``layers`` lists; Snake [C])."""
    enc = {"snake1": "3", "conv1": "4", "res_unit1": "0", "res_unit2": "1", "res_unit3": "2"}
    dec = {"snake1": "0", "conv_t1": "1", "res_unit1": "2", "res_unit2": "3", "res_unit3": "4"}
    unit = {"snake1": "0", "conv1": "1", "snake2": "2", "conv2": "3"}
    out = {}
    for key, t in sd.items():
        side, rest = key.split(".", 1)
        if m := re.match(r"^block\.(\d+)\.(\w+)\.(.*)$", rest):
            inner = m[3]
            if m[2].startswith("res_unit"):
                first, tail = inner.split(".", 1)
                inner = f"layers.{unit[first]}.{tail}"
            new = f"{side}.layers.{int(m[1]) + 1}.layers.{(enc if side == 'encoder' else dec)[m[2]]}.{inner}"
        else:
            first, tail = rest.split(".", 1)
            new = f"{side}.layers.{ {'conv1': 0, 'snake1': blocks + 1, 'conv2': blocks + 2}[first]}.{tail}"
        out[new] = _c(t.reshape(-1) if key.endswith((".alpha", ".beta")) else t)
    return out


def projection_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers StableAudioProjectionModel -> the seconds_start / seconds_total NumberConditioners."""
    out = {}
    for key, t in sd.items():
        which, rest = key.split(".", 1)
        if which == "text_projection":  # T5 width != conditioning width: the T5Conditioner's proj_out
            out[f"prompt.proj_out.{rest}"] = _c(t)
            continue
        name = {"start_number_conditioner": "seconds_start", "end_number_conditioner": "seconds_total"}[which]
        out[f"{name}.{rest.replace('time_positional_embedding', 'embedder.embedding')}"] = _c(t)
    return out


def sao_checkpoint(pipe, blocks: int = len(STRIDES)) -> dict[str, torch.Tensor]:
    """The pipeline's DiT, VAE (of ``blocks`` strided blocks) and projection as one
    stable-audio-tools checkpoint."""
    sections = (("model.model.", dit_original(pipe.transformer.state_dict())),
                ("pretransform.model.", vae_original(pipe.vae.state_dict(), blocks)),
                ("conditioner.conditioners.", projection_original(pipe.projection_model.state_dict())))
    return {prefix + k: v for prefix, part in sections for k, v in part.items()}


def t5_base_folder(encoder, folder: Path, seed: int = 5) -> Path:
    """ComfyUI's ``t5_base.safetensors`` as google-t5/t5-base ships it: a whole
    T5ForConditionalGeneration (``encoder``'s weights, a random decoder and LM head beside them),
    saved by transformers; -> its ``model.safetensors``."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    whole = T5ForConditionalGeneration(T5Config(**{**encoder.config.to_dict(), "is_encoder_decoder": True,
                                                   "architectures": ["T5ForConditionalGeneration"]})).eval()
    missing, unexpected = whole.load_state_dict(encoder.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("decoder.", "lm_head.")) for k in missing), (missing, unexpected)
    whole.save_pretrained(folder)
    return folder / "model.safetensors"
