"""Shared pieces of the Flux tests: diffusers' pipelines on the same folder (weights copied
to fresh memory, as ours are: see checkpoint_files.aligned) and our generator."""

from __future__ import annotations

import functools

import torch

PROMPT = "a red circle"


@functools.lru_cache(maxsize=4)
def diffusers_pipeline(folder, cls_name: str = "FluxPipeline"):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        for p in module.parameters():
            p.data = p.data.clone()  # 64-byte aligned, like our loaders' tensors
    return pipe


def diffusers_latents(pipe, height: int, width: int, seed: int, **call) -> torch.Tensor:
    """diffusers' final latents, unpacked to [1, C, h, w] (our loop's layout)."""
    out = pipe(height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
               **call).images
    return pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)


@functools.lru_cache(maxsize=4)
def generator(folder, **options):
    from omniloop.api.generator import VideoGenerator

    return VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32", **options)


def diffusers_with_loras(folder, files, adapters, height: int, width: int, seed: int, **call) -> torch.Tensor:
    """diffusers' FluxPipeline with ``adapters`` [(name, strength)] loaded and activated as a
    user would (``lora_state_dict`` + ``load_lora_into_transformer`` + ``set_adapters``), the
    text-encoder part injected with peft itself (transformers' own loader wants a newer peft
    than this environment has) and scaled as ``set_adapters`` scales it. The prompt is encoded
    by those (LoRA-patched) encoders under no_grad, as the pipeline would."""
    import diffusers
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    te_adapters = []
    for name, _ in adapters:
        sd, alphas, meta = pipe.lora_state_dict(str(files[name]), return_alphas=True, return_lora_metadata=True)
        te = {k.removeprefix("text_encoder."): v for k, v in sd.items() if k.startswith("text_encoder.")}
        sd = {k: v for k, v in sd.items() if not k.startswith("text_encoder.")}
        pipe.load_lora_into_transformer(sd, network_alphas=alphas, transformer=pipe.transformer, adapter_name=name,
                                        metadata=meta)
        if te:
            config = {k.removeprefix("text_encoder."): v for k, v in (meta or {}).items() if k.startswith("text_encoder.")}
            inject_adapter_in_model(LoraConfig(**config), pipe.text_encoder, adapter_name=name)
            set_peft_model_state_dict(pipe.text_encoder, te, adapter_name=name)
            te_adapters.append(name)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        for p in module.parameters():
            p.data = p.data.clone()
    if adapters:
        set_weights_and_activate_adapters(pipe.transformer, [n for n, _ in adapters], [w for _, w in adapters])
    for module in pipe.text_encoder.modules():
        if isinstance(module, LoraLayer) and te_adapters:
            module.set_adapter(te_adapters)
            for name, weight in adapters:
                if name in te_adapters:
                    module.set_scale(name, weight)
    prompt = call.pop("prompt")
    with torch.no_grad():
        pooled = pipe._get_clip_prompt_embeds(prompt, device=torch.device("cpu"))
        t5 = pipe._get_t5_prompt_embeds(prompt, device=torch.device("cpu"))
    return diffusers_latents(pipe, height, width, seed, prompt_embeds=t5, pooled_prompt_embeds=pooled, **call)
