"""FLUX.2 weights in the original layouts ComfyUI users hold: the inverse of the key maps the
loaders read (each checked against diffusers' own ``from_single_file`` conversion where it has
one, so a wrong inverse cannot hide)."""

from __future__ import annotations

import torch

_TOP = {
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
}
_DOUBLE = {
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm", "attn.to_out.0": "img_attn.proj",
    "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2", "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm", "attn.to_add_out": "txt_attn.proj",
    "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
           "attn.norm_k": "norm.key_norm"}


def flux2_dit_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``Flux2Transformer2DModel`` -> BFL's FLUX.2 keys (fused q/k/v per stream, RMSNorm
    ``scale``s, the final adaLN as (shift, scale))."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        module, _, param = key.rpartition(".")
        parts = module.split(".")
        if parts[0] == "transformer_blocks":
            inner = ".".join(parts[2:])
            if inner in ("attn.to_q", "attn.add_q_proj"):
                stream = "img" if inner == "attn.to_q" else "txt"
                names = ("to_q", "to_k", "to_v") if stream == "img" else ("add_q_proj", "add_k_proj", "add_v_proj")
                out[f"double_blocks.{parts[1]}.{stream}_attn.qkv.weight"] = torch.cat(
                    [sd[f"transformer_blocks.{parts[1]}.attn.{n}.weight"] for n in names])
                continue
            if inner in ("attn.to_k", "attn.to_v", "attn.add_k_proj", "attn.add_v_proj"):
                continue
            name = _DOUBLE[inner]
            out[f"double_blocks.{parts[1]}.{name}.{'scale' if 'norm' in name else param}"] = tensor
        elif parts[0] == "single_transformer_blocks":
            name = _SINGLE[".".join(parts[2:])]
            out[f"single_blocks.{parts[1]}.{name}.{'scale' if 'norm' in name else param}"] = tensor
        else:
            if module == "norm_out.linear":
                scale, shift = tensor.chunk(2, dim=0)
                tensor = torch.cat([shift, scale])
            out[f"{_TOP[module]}.{param}"] = tensor
    return out


def flux2_vae_original(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKLFlux2`` -> ComfyUI's ``flux2-vae.safetensors`` (the LDM keys of
    the KL autoencoder, the quant convs under encoder./decoder. as BFL's, and the ``bn.`` stats)."""
    from tests.models.comfy.original_layout import kl_vae_original

    own = {k: v for k, v in sd.items() if k.startswith("bn.")}
    ldm = kl_vae_original({k: v for k, v in sd.items() if not k.startswith("bn.")}, levels)
    renamed = {("encoder." + k if k.startswith("quant_conv.") else "decoder." + k if k.startswith("post_quant_conv.")
                else k): v for k, v in ldm.items()}
    return {**renamed, **own}
