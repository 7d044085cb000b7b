"""Tiny single files in the ORIGINAL key layouts (Wan-AI's repos, BFL's ``flux1-dev`` and
``ae``), made from tiny diffusers models by the inverse of diffusers' single-file key maps
(``diffusers.loaders.single_file_utils``), plus ComfyUI's scaled-fp8 storage. Written here
from diffusers' forward maps, independent of the loader under test; each test first checks
the round trip through diffusers' own ``from_single_file``."""

from __future__ import annotations

import re

import torch

# diffusers key -> original Wan key (inverse of convert_wan_transformer_to_diffusers)
_WAN_DIT = (
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"^blocks\.(\d+)\.attn1\.to_([qkv])\.", r"blocks.\1.self_attn.\2."),
    (r"^blocks\.(\d+)\.attn1\.norm_([qk])\.", r"blocks.\1.self_attn.norm_\2."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"^blocks\.(\d+)\.attn2\.to_([qkv])\.", r"blocks.\1.cross_attn.\2."),
    (r"^blocks\.(\d+)\.attn2\.add_([kv])_proj\.", r"blocks.\1.cross_attn.\2_img."),
    (r"^blocks\.(\d+)\.attn2\.norm_added_k\.", r"blocks.\1.cross_attn.norm_k_img."),
    (r"^blocks\.(\d+)\.attn2\.norm_([qk])\.", r"blocks.\1.cross_attn.norm_\2."),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
)


def _renamed(sd: dict[str, torch.Tensor], table) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in table:
            if re.match(pattern, key):
                key = re.sub(pattern, repl, key, count=1)
                break
        out[key] = tensor.detach().clone().contiguous()
    return out


def wan_dit_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(A VACE DiT's control blocks map as the main blocks under ``vace_``, their proj_in /
    proj_out as before_proj / after_proj: diffusers' VACE renames.)"""
    out = _renamed({k: v for k, v in sd.items() if not k.startswith("vace_blocks.")}, _WAN_DIT)
    control = _renamed({k[len("vace_"):]: v for k, v in sd.items() if k.startswith("vace_blocks.")}, _WAN_VACE + _WAN_DIT)
    return {**out, **{f"vace_{k}": v for k, v in control.items()}}


_WAN_VACE = ((r"^blocks\.(\d+)\.proj_in\.", r"blocks.\1.before_proj."),
             (r"^blocks\.(\d+)\.proj_out\.", r"blocks.\1.after_proj."))


def wan_vae_original(sd: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKLWan`` (Wan2.1) -> the original ``WanVAE_`` keys (inverse of
    convert_wan_vae_to_diffusers): decoder levels flatten into ``decoder.upsamples.{i}``
    (``num_res_blocks + 1`` resnets then the upsampler per level)."""
    per_level = num_res_blocks + 2
    resnet = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."), ("norm2.gamma", "residual.3.gamma"),
              ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))
    out = {}
    for key, tensor in sd.items():
        new = key
        for side in ("encoder", "decoder"):
            new = re.sub(rf"^{side}\.conv_in\.", f"{side}.conv1.", new)
            new = re.sub(rf"^{side}\.norm_out\.gamma$", f"{side}.head.0.gamma", new)
            new = re.sub(rf"^{side}\.conv_out\.", f"{side}.head.2.", new)
            new = re.sub(rf"^{side}\.mid_block\.attentions\.0\.", f"{side}.middle.1.", new)
            m = re.match(rf"^{side}\.mid_block\.resnets\.(\d)\.(.*)$", new)
            if m:
                new = f"{side}.middle.{2 * int(m[1])}.{m[2]}"
        new = re.sub(r"^quant_conv\.", "conv1.", new)
        new = re.sub(r"^post_quant_conv\.", "conv2.", new)
        new = re.sub(r"^encoder\.down_blocks\.", "encoder.downsamples.", new)
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", new)
        if m:
            new = f"decoder.upsamples.{int(m[1]) * per_level + int(m[2])}.{m[3]}"
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", new)
        if m:
            new = f"decoder.upsamples.{int(m[1]) * per_level + num_res_blocks + 1}.{m[2]}"
        m = re.match(r"^((?:encoder|decoder)\.(?:downsamples|upsamples|middle)\.\d+\.)(.*)$", new)
        if m:
            rest = m[2]
            for a, b in resnet:
                if rest.startswith(a):
                    rest = b + rest[len(a):]
            new = m[1] + rest
        out[new] = tensor.detach().clone().contiguous()
    return out


def wan22_vae_original(sd: dict[str, torch.Tensor], num_res_blocks: int) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKLWan`` (Wan2.2: residual levels) -> the original Wan2.2 ``WanVAE_``
    keys (inverse of diffusers' ``convert_vae_22``): each level nests its blocks,
    ``encoder.downsamples.{i}.downsamples.{j}`` (resnets, then the downsampler at
    ``num_res_blocks``) and ``decoder.upsamples.{i}.upsamples.{j}`` (resnets, then the upsampler
    at ``num_res_blocks + 1``)."""
    nested = {}
    for key, tensor in sd.items():
        new = key
        for side, word, sampler, last in (("encoder", "down", "downsampler", num_res_blocks),
                                          ("decoder", "up", "upsampler", num_res_blocks + 1)):
            m = re.match(rf"^{side}\.{word}_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", new)
            if m:
                new = f"{side}.{word}samples.{m[1]}.{word}samples.{m[2]}.RESNET.{m[3]}"
            m = re.match(rf"^{side}\.{word}_blocks\.(\d+)\.{sampler}\.(.*)$", new)
            if m:
                new = f"{side}.{word}samples.{m[1]}.{word}samples.{last}.{m[2]}"
        nested[new] = tensor
    out = {}
    for key, tensor in wan_vae_original(nested, num_res_blocks).items():
        if ".RESNET." in key:
            head, rest = key.split(".RESNET.")
            for a, b in (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."),
                         ("norm2.gamma", "residual.3.gamma"), ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut.")):
                if rest.startswith(a):
                    rest = b + rest[len(a):]
            key = f"{head}.{rest}"
        out[key] = tensor
    return out


def scaled_fp8(sd: dict[str, torch.Tensor], *, marker: bool = True) -> dict[str, torch.Tensor]:
    """ComfyUI's scaled-fp8 storage of ``sd``: every 2-D ``*.weight`` as ``float8_e4m3fn``
    with a per-layer fp32 ``scale_weight`` (amax / 448) and a ``scale_input`` of 1; the
    other tensors kept; plus the ``scaled_fp8`` marker."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.abs().amax().float() / 448.0).clamp_min(1e-12).reshape(1)
            out[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            base = key[: -len(".weight")]
            out[f"{base}.scale_weight"] = scale
            out[f"{base}.scale_input"] = torch.ones(1)
        else:
            out[key] = tensor
    if marker:
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


# diffusers FluxTransformer2DModel -> BFL keys (inverse of convert_flux_transformer_checkpoint_to_diffusers)
_FLUX_PLAIN = (
    (r"^time_text_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"^time_text_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"^time_text_embed\.text_embedder\.linear_1\.", "vector_in.in_layer."),
    (r"^time_text_embed\.text_embedder\.linear_2\.", "vector_in.out_layer."),
    (r"^time_text_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"^time_text_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"^context_embedder\.", "txt_in."),
    (r"^x_embedder\.", "img_in."),
    (r"^proj_out\.", "final_layer.linear."),
    (r"^transformer_blocks\.(\d+)\.norm1\.linear\.", r"double_blocks.\1.img_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"double_blocks.\1.txt_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"double_blocks.\1.img_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"double_blocks.\1.img_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.", r"double_blocks.\1.txt_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.2\.", r"double_blocks.\1.txt_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"^single_transformer_blocks\.(\d+)\.norm\.linear\.", r"single_blocks.\1.modulation.lin."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"),
    (r"^single_transformer_blocks\.(\d+)\.proj_out\.", r"single_blocks.\1.linear2."),
)


def flux_dit_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {k: v.detach() for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    for leaf in ("weight", "bias"):
        for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")}):
            p = f"transformer_blocks.{i}.attn"
            out[f"double_blocks.{i}.img_attn.qkv.{leaf}"] = torch.cat([sd.pop(f"{p}.to_{n}.{leaf}") for n in "qkv"])
            out[f"double_blocks.{i}.txt_attn.qkv.{leaf}"] = torch.cat([sd.pop(f"{p}.add_{n}_proj.{leaf}") for n in "qkv"])
        for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")}):
            p = f"single_transformer_blocks.{i}"
            out[f"single_blocks.{i}.linear1.{leaf}"] = torch.cat(
                [sd.pop(f"{p}.attn.to_{n}.{leaf}") for n in "qkv"] + [sd.pop(f"{p}.proj_mlp.{leaf}")])
        if f"norm_out.linear.{leaf}" in sd:  # absent from a part of the DiT (benchmarks/comfy_weights.py streams blocks)
            scale, shift = sd.pop(f"norm_out.linear.{leaf}").chunk(2)
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale])
    out.update(_renamed(sd, _FLUX_PLAIN))
    return {k: v.clone().contiguous() for k, v in out.items()}


def kl_vae_original(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKL`` -> the LDM/BFL ``ae.safetensors`` keys (inverse of
    convert_ldm_vae_checkpoint): decoder levels reversed, attention as 1x1 convs."""
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}

    def up(m: re.Match) -> str:
        return f"decoder.up.{levels - 1 - int(m[1])}"

    table = (
        (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
        (r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}."),
        (r"^(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.",
         lambda m: f"{m[1]}.mid.attn_1.{attn[m[2]]}."),
        (r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block."),
        (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
        (r"^decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"{up(m)}.block."),
        (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"{up(m)}.upsample."),
    )
    # the mid attention's linear weights are 1x1 convs in the LDM file
    sd = {k.replace("conv_shortcut.", "nin_shortcut."): v[:, :, None, None] if ".mid_block.attentions." in k and v.dim() == 2 else v
          for k, v in sd.items()}
    return _renamed(sd, table)


def flux_checkpoint_original(pipe, *, text: tuple[str, ...] = ("clip_l", "t5xxl")) -> dict[str, torch.Tensor]:
    """A diffusers ``FluxPipeline`` as ComfyUI's full checkpoint (``flux1-dev-fp8.safetensors``,
    ``CheckpointSave``'s layout): the BFL DiT under ``model.diffusion_model.``, the ``ae`` under
    ``vae.``, CLIP-L (transformers 4 keys, ``text_model.``; its ``text_projection`` and
    ``logit_scale`` beside it) under ``text_encoders.clip_l.``, T5-XXL (one copy of the tied
    embedding) under ``text_encoders.t5xxl.transformer.``; ``text``: the encoders written."""
    full = {f"model.diffusion_model.{k}": v for k, v in flux_dit_original(pipe.transformer.state_dict()).items()}
    full |= {f"vae.{k}": v for k, v in kl_vae_original(pipe.vae.state_dict(), levels=4).items()}
    if "clip_l" in text:
        clip = pipe.text_encoder
        full |= {f"text_encoders.clip_l.transformer.text_model.{k}": v.clone() for k, v in clip.state_dict().items()}
        width = clip.config.hidden_size
        full["text_encoders.clip_l.transformer.text_projection.weight"] = torch.eye(width)
        full["text_encoders.clip_l.logit_scale"] = torch.tensor(4.6052)
    if "t5xxl" in text:
        full |= {f"text_encoders.t5xxl.transformer.{k}": v.clone() for k, v in pipe.text_encoder_2.state_dict().items()
                 if k != "encoder.embed_tokens.weight"}
    return full


def comfy_quant_fp8(sd: dict[str, torch.Tensor], fmt: str = "float8_e4m3fn") -> dict[str, torch.Tensor]:
    """ComfyUI's mixed-precision storage (comfy/ops.py MixedPrecisionOps): every 2-D ``*.weight``
    in fp8 with ``weight_scale``, an ``input_scale`` and a ``comfy_quant`` JSON-bytes tensor."""
    import json

    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.endswith(".weight") and tensor.dim() == 2:
            base = key[: -len(".weight")]
            scale = (tensor.abs().amax().float() / 448.0).clamp_min(1e-12)
            out[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[f"{base}.weight_scale"] = scale
            out[f"{base}.input_scale"] = torch.tensor(1.0)
            out[f"{base}.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
        else:
            out[key] = tensor
    return out


# -- LTX-2 (Lightricks' layout, ComfyUI's checkpoints/ltx-2-19b-*.safetensors) ----------------
# diffusers' names -> Lightricks' (the inverse of diffusers' convert_ltx2_transformer_to_diffusers)
LTX2_DIT_TO_ORIGINAL = (
    (r"^time_embed\.", "adaln_single."), (r"^audio_time_embed\.", "audio_adaln_single."),
    (r"^(audio_)?proj_in\.", r"\1patchify_proj."),
    (r"^av_cross_attn_video_scale_shift\.", "av_ca_video_scale_shift_adaln_single."),
    (r"^av_cross_attn_video_a2v_gate\.", "av_ca_a2v_gate_adaln_single."),
    (r"^av_cross_attn_audio_scale_shift\.", "av_ca_audio_scale_shift_adaln_single."),
    (r"^av_cross_attn_audio_v2a_gate\.", "av_ca_v2a_gate_adaln_single."),
    (r"\.video_a2v_cross_attn_scale_shift_table$", ".scale_shift_table_a2v_ca_video"),
    (r"\.audio_a2v_cross_attn_scale_shift_table$", ".scale_shift_table_a2v_ca_audio"),
    (r"\.norm_q\.", ".q_norm."), (r"\.norm_k\.", ".k_norm."),
)


def ltx2_vae_original(sd: dict[str, torch.Tensor], stages: int) -> dict[str, torch.Tensor]:
    """diffusers' video VAE names -> Lightricks' (one list of stages and samplers)."""
    out = {"vae.per_channel_statistics.channel": torch.arange(8.0),
           "vae.per_channel_statistics.mean-of-stds": torch.ones(8)}
    for key, tensor in sd.items():
        key = {"latents_mean": "per_channel_statistics.mean-of-means",
               "latents_std": "per_channel_statistics.std-of-means"}.get(key, key).replace(".resnets.", ".res_blocks.")
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)$", key):
            key = f"encoder.down_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", key):
            key = f"encoder.down_blocks.{2 * int(m[1])}.{m[2]}"
        elif key.startswith("encoder.mid_block."):
            key = key.replace("encoder.mid_block.", f"encoder.down_blocks.{2 * stages}.")
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", key):
            key = f"decoder.up_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(.*)$", key):
            key = f"decoder.up_blocks.{2 * int(m[1]) + 2}.{m[2]}"
        elif key.startswith("decoder.mid_block."):
            key = key.replace("decoder.mid_block.", "decoder.up_blocks.0.")
        out[f"vae.{key}"] = tensor.clone()
    return out


def _substituted(sd: dict[str, torch.Tensor], table) -> dict[str, torch.Tensor]:
    """Every rule of ``table`` applied in turn to every key (diffusers' conversion script's
    ``str.replace`` loop, inverted)."""
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in table:
            key = re.sub(pattern, repl, key)
        out[key] = tensor.detach().clone().contiguous()
    return out


def ltx2_dit_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' LTX-2 transformer -> the checkpoint's ``model.diffusion_model.`` section."""
    return {f"model.diffusion_model.{k}": v for k, v in _substituted(sd, LTX2_DIT_TO_ORIGINAL).items()}


# diffusers' LTX2TextConnectors -> Lightricks' (the inverse of diffusers' scripts/convert_ltx2_to_diffusers.py
# LTX_2_0_CONNECTORS_KEYS_RENAME_DICT; the projection sits at the top level, the connectors beside the DiT)
_LTX2_CONNECTORS = (
    (r"^text_proj_in\.", "text_embedding_projection.aggregate_embed."),
    (r"^(video|audio)_connector\.", r"model.diffusion_model.\1_embeddings_connector."),
    (r"\.transformer_blocks\.", ".transformer_1d_blocks."),
    (r"\.norm_q\.", ".q_norm."), (r"\.norm_k\.", ".k_norm."),
)
# diffusers' LTX2Vocoder -> Lightricks' HiFi-GAN names (inverse of LTX_2_0_VOCODER_RENAME_DICT)
_LTX2_VOCODER = ((r"^upsamplers\.", "ups."), (r"^resnets\.", "resblocks."), (r"^conv_in\.", "conv_pre."),
                 (r"^conv_out\.", "conv_post."))


def ltx2_connectors_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _substituted(sd, _LTX2_CONNECTORS)


def ltx2_vocoder_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"vocoder.{k}": v for k, v in _substituted(sd, _LTX2_VOCODER).items()}


def ltx2_audio_vae_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {"latents_mean": "per_channel_statistics.mean-of-means", "latents_std": "per_channel_statistics.std-of-means"}
    return {f"audio_vae.{names.get(k, k)}": v.clone() for k, v in sd.items()}


def ltx2_checkpoint_original(folder) -> dict[str, torch.Tensor]:
    """A diffusers LTX2Pipeline folder as one ComfyUI checkpoint (ltx-2-19b-dev.safetensors):
    DiT and connectors, video VAE, audio VAE, vocoder (no text encoder: ComfyUI holds Gemma apart)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    def sd(sub: str) -> dict[str, torch.Tensor]:
        return load_file(Path(folder) / sub / "diffusion_pytorch_model.safetensors")

    stages = len(json.loads((Path(folder) / "vae" / "config.json").read_text())["block_out_channels"])
    return (ltx2_dit_original(sd("transformer")) | ltx2_connectors_original(sd("connectors"))
            | ltx2_vae_original(sd("vae"), stages) | ltx2_audio_vae_original(sd("audio_vae"))
            | ltx2_vocoder_original(sd("vocoder")))


def gemma3_comfy(sd: dict[str, torch.Tensor], spiece: bytes | None = None) -> dict[str, torch.Tensor]:
    """transformers' Gemma3ForConditionalGeneration -> ComfyUI's gemma_3_12B_it file: the
    language model under ``model.`` (ComfyUI's llama.py names are transformers' Gemma 3 text
    names), the vision tower and projector beside it, no ``lm_head`` (tied), and ``spiece``
    (the tokenizer's SentencePiece model proto) as a uint8 ``spiece_model`` when given."""
    out = {}
    for key, tensor in sd.items():
        if key.startswith("model.language_model."):
            out["model." + key.removeprefix("model.language_model.")] = tensor.clone()
        elif key.startswith("model.vision_tower.vision_model."):
            out["vision_model." + key.removeprefix("model.vision_tower.vision_model.")] = tensor.clone()
        elif key.startswith("model.multi_modal_projector."):
            out[key.removeprefix("model.")] = tensor.clone()
    if spiece is not None:
        out["spiece_model"] = torch.tensor(list(spiece), dtype=torch.uint8)
    return out


def comfy_quant_nvfp4(sd: dict[str, torch.Tensor], quantize=lambda key: True) -> dict[str, torch.Tensor]:
    """ComfyUI's nvfp4 storage (the ``*_fp4_mixed`` releases), written by comfy-kitchen's own
    ``TensorCoreNVFP4Layout`` (the library ComfyUI quantizes with): each 2-D ``*.weight`` with
    sizes in multiples of 16 that ``quantize`` picks becomes packed E2M1 codes, ``weight_scale``
    (block scales, cuBLAS layout), ``weight_scale_2``, an ``input_scale`` and ``comfy_quant``;
    the other tensors stay as they are ("mixed")."""
    import json

    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.endswith(".weight") and tensor.dim() == 2 and not tensor.shape[0] % 16 and not tensor.shape[1] % 16 \
                and quantize(key):
            base = key[: -len(".weight")]
            qdata, params = TensorCoreNVFP4Layout.quantize(tensor.float())
            for suffix, value in TensorCoreNVFP4Layout.state_dict_tensors(qdata, params).items():
                out[f"{base}.weight{suffix}"] = value.contiguous()
            out[f"{base}.input_scale"] = torch.tensor(1.0)
            out[f"{base}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
        else:
            out[key] = tensor
    return out
