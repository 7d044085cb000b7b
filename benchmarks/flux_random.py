"""Random-weight Flux pipelines for benchmarks, built in memory (no checkpoint on disk: a
12B transformer would take longer to save and read back than to benchmark).

``size="dev"``: the FLUX.1-dev transformer (19 double + 38 single blocks, width 3072,
11.9B params) and the FLUX.1 VAE, with small text encoders whose widths are the real
ones (T5 d_model 4096, CLIP 768; one layer each: the DiT's inputs have the real shapes,
the encoders' own cost is not what these figures measure). ``size="tiny"``: the 2-block
toy of the tests, for CPU smoke runs. The pipeline is the one the family builds from a
diffusers folder (``flux.spec.build_flux``), with the loader's caches attached.
"""

from __future__ import annotations

import dataclasses
import functools
import string
import tempfile
from pathlib import Path

import torch

from omniloop.models.autoencoders.kl2d import KL2DAutoencoder, KL2DConfig
from omniloop.models.families.flux.model import FluxConfig, FluxTransformer
from omniloop.models.families.flux.presets import FLUX1_DEV, FLUX1_DEV_SCHEDULER, FLUX1_VAE
from omniloop.models.families.flux.spec import BLOCK_GEMMS, FLUX, build_flux, flux_variant
from omniloop.models.load_options import apply_load_options
from omniloop.models.loader import attach_caches
from omniloop.models.model_spec import LoadOptions
from omniloop.models.text.clip import CLIPTextEncoder
from omniloop.models.text.t5 import T5TextEncoder
from omniloop.pipeline.samplers.base import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet

CORPUS = ["a red circle", "a blue square on a table", "a cat in the snow", "a city at night, neon lights",
          "portrait of an old fisherman", "a bowl of fruit, studio light"]
SIZES = ("dev", "tiny")


def _configs(size: str) -> tuple[dict, dict, int, int]:
    if size == "dev":
        return dict(FLUX1_DEV), dict(FLUX1_VAE), 4096, 768
    dit = dict(FLUX1_DEV, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
    vae = dict(FLUX1_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4)
    return dit, vae, 32, 24


@functools.cache  # one per process: Unigram training breaks score ties in hash order, so two
def _tokenizers():  # trainings can order the vocab differently, and the bench's two builds must match
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import CLIPTokenizer, T5TokenizerFast

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(CORPUS * 20, vocab_size=80, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    t5 = T5TokenizerFast(tokenizer_object=sp._tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in string.ascii_lowercase + ",.'-":
            vocab[c + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77), t5


OUTPUT_LAYERS = ("to_out.0.weight", "to_add_out.weight", "proj_out.weight", "ff.net.2.weight", "ff_context.net.2.weight")


def shrink_outputs(dit: torch.nn.Module, factor: float = 0.1) -> None:
    """Keep a deep random stack finite in bf16: small output projections, as trained models have."""
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if name.endswith(OUTPUT_LAYERS):
                p.mul_(factor)


def random_flux_pipeline(size: str, options: LoadOptions, *, max_sequence_length: int = 512):
    """A built Flux Pipeline (and its ModelSpec) with random weights of ``size``."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    dit_cfg, vae_cfg, t5_dim, clip_dim = _configs(size)
    clip_tok, t5_tok = _tokenizers()
    device, dtype = options.device, options.dtype
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # init in the deploy dtype: no fp32 copy of 12B params
    try:
        with torch.device(device):
            dit = FluxTransformer(FluxConfig(**dit_cfg))
            vae = KL2DAutoencoder(KL2DConfig(**vae_cfg))
    finally:
        torch.set_default_dtype(default)
    with torch.device(device):
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=clip_dim, intermediate_size=2 * clip_dim,
                                            num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=77,
                                            bos_token_id=0, eos_token_id=1, pad_token_id=1)).to(dtype)
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=t5_dim, d_kv=min(64, t5_dim), d_ff=2 * t5_dim,
                                     num_layers=1, num_heads=max(1, t5_dim // 64), relative_attention_num_buckets=8,
                                     dropout_rate=0.0, feed_forward_proj="gated-gelu")).to(dtype)
    shrink_outputs(dit)
    blocks = [*dit.transformer_blocks, *dit.single_transformer_blocks]
    components = {
        "transformer": apply_load_options(dit, options, blocks=blocks, fp8_layers=BLOCK_GEMMS),
        "vae": vae.eval().requires_grad_(False),
        "text_encoder": CLIPTextEncoder(clip, clip_tok),
        "text_encoder_2": T5TextEncoder(t5, t5_tok, max_sequence_length),
        "sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler", dict(FLUX1_DEV_SCHEDULER))),
    }
    pipeline = build_flux(flux_variant({}), {}, components, options)
    return FLUX, attach_caches(pipeline, options, FLUX.lora)


def diffusers_flux_pipeline(pipeline):
    """diffusers' ``FluxPipeline`` over the tensors of our random ``pipeline`` (built by
    ``random_flux_pipeline`` without FP8: the transformer and VAE keys are diffusers' own, so
    their modules take our tensors by assignment, no second copy of 12B params; the text
    encoders and tokenizers are the same objects)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    ours = pipeline.components
    dit, vae = ours["transformer"], ours["vae"]
    with torch.device("meta"):
        ref_dit = FluxTransformer2DModel(**dataclasses.asdict(dit.config))
        ref_vae = AutoencoderKL(**dataclasses.asdict(vae.config))
    ref_dit.load_state_dict(dit.state_dict(), strict=True, assign=True)
    ref_vae.load_state_dict(vae.state_dict(), strict=True, assign=True)
    clip, t5 = ours["text_encoder"], ours["text_encoder_2"]
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_DEV_SCHEDULER), vae=ref_vae.eval(),
                        text_encoder=clip.model, tokenizer=clip.tokenizer, text_encoder_2=t5.model, tokenizer_2=t5.tokenizer,
                        transformer=ref_dit.eval())


def save_random_loras(model: torch.nn.Module, count: int, rank: int, folder: Path | None = None,
                      targets: tuple[str, ...] = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")) -> list[Path]:
    """``count`` random diffusers-layout LoRA files (rank ``rank``, alpha = rank) on
    ``targets`` of every block of ``model``."""
    from safetensors.torch import save_file

    folder = Path(folder or tempfile.mkdtemp(prefix="flux_loras_"))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(targets)]
    files = []
    for i in range(count):
        gen = torch.Generator().manual_seed(100 + i)
        sd = {}
        for n in names:
            linear = model.get_submodule(n)
            sd[f"transformer.{n}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=gen).bfloat16() * 0.01
            sd[f"transformer.{n}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=gen).bfloat16() * 0.01
        path = folder / f"lora_{i}.safetensors"
        save_file(sd, str(path))
        files.append(path)
    return files
