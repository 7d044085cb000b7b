"""Random-weight Wan checkpoints in the diffusers layout, for benchmarks (diffusers and
transformers build and save them; omniloop loads them like any user checkpoint)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

CORPUS = ["a red circle moving right", "a blue square moving left", "a green triangle bouncing", "low quality"]


SIZES = ("full", "small", "tiny")
A14B_SIZES = ("a14b", "tiny")


def random_t5_tokenizer():
    """A T5 tokenizer over a 60-piece SentencePiece vocabulary trained on ``CORPUS`` (Wan's and
    FAR's random checkpoints)."""
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(CORPUS * 20, vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    return T5TokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)


def random_umt5(tokenizer, d_model: int):
    """A one-layer random UMT5 text encoder of width ``d_model`` (the DiT's ``text_dim``),
    created on the current default device."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=64, num_layers=1,
                                       num_heads=4, relative_attention_num_buckets=8))


def save_random_wan(folder: Path | None = None, *, size: str, device: str = "cpu") -> Path:
    """``size``: "full" = the Wan2.1-T2V-1.3B architecture (30 blocks) with the real VAE;
    "small" = 8 blocks of width 128; "tiny" = the 2-block toy (both with a small VAE)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from omniloop.models.families.wan.presets import WAN21_T2V_1_3B, WAN21_VAE

    folder = Path(folder or tempfile.mkdtemp(prefix="wan_random_"))
    tokenizer = random_t5_tokenizer()
    dit = dict(WAN21_T2V_1_3B)
    vae = dict(WAN21_VAE)
    if size == "small":
        dit.update(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=8, text_dim=32, freq_dim=32)
    if size == "tiny":
        dit.update(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, text_dim=32, freq_dim=16)
    if size != "full":
        vae.update(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    torch.manual_seed(0)
    with torch.device(device):
        text = random_umt5(tokenizer, dit["text_dim"])
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text, vae=AutoencoderKLWan(**vae),
                           transformer=WanTransformer3DModel(**dit),
                           scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=3.0))
        pipe.save_pretrained(folder)
    return folder


def save_random_wan22(folder: Path | None = None, *, size: str, layers: int | None = None, device: str = "cpu",
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Wan2.2-T2V-A14B-shaped checkpoint: two experts (high-noise ``transformer``, low-noise
    ``transformer_2``, ``boundary_ratio`` 0.875, UniPC with flow_shift 12 as the T2V A14B
    release samples) and the Wan2.1 VAE. ``size``: "a14b" = each expert the published 14B DiT
    (40 blocks of width 5120), built and saved in ``dtype`` (two fp32 experts would take 112 GB);
    "tiny" = two 2-block toys with a small VAE. ``layers``: blocks per expert, fewer than the
    published 40 when memory or disk requires (say so beside the figures)."""
    if size not in A14B_SIZES:
        raise ValueError(f"size={size!r}; pass one of {A14B_SIZES}")
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from omniloop.models.families.wan.presets import WAN21_T2V_14B, WAN21_VAE

    folder = Path(folder or tempfile.mkdtemp(prefix="wan22_random_"))
    tokenizer = random_t5_tokenizer()
    dit, vae = dict(WAN21_T2V_14B), dict(WAN21_VAE)
    if size == "tiny":
        dit.update(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, text_dim=32, freq_dim=16)
        vae.update(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    if layers is not None:
        dit.update(num_layers=layers)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the experts are created in dtype: no fp32 copy of 2 x 14B params
    try:
        with torch.device(device):
            experts = [WanTransformer3DModel(**dit) for _ in range(2)]
    finally:
        torch.set_default_dtype(default)
    with torch.device(device):
        text = random_umt5(tokenizer, dit["text_dim"])
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text, vae=AutoencoderKLWan(**vae), transformer=experts[0],
                           transformer_2=experts[1], boundary_ratio=0.875,
                           scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=12.0))
        pipe.save_pretrained(folder)
    return folder


def random_pair(diffusers_cls, cfg: dict, load_ours, device, dtype: torch.dtype, *, prefix: str):
    """One random ``diffusers_cls(**cfg)`` (seed 0, built on ``device``), saved to a temp folder and
    loaded both ways users load it: ``(diffusers_model, ours)`` in ``dtype`` on ``device``, eval, no
    grads (``load_ours(folder, device=, dtype=)``: our loader of that folder)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    torch.manual_seed(0)
    with torch.device(device):
        diffusers_cls(**cfg).save_pretrained(folder)
    ref = diffusers_cls.from_pretrained(folder, torch_dtype=dtype).to(device).eval().requires_grad_(False)
    ours = load_ours(folder, device=device, dtype=dtype).eval().requires_grad_(False)
    return ref, ours


def random_wan_vaes(device, dtype: torch.dtype, *, tiny: bool = False):
    """One random Wan2.1 VAE (diffusers' ``AutoencoderKLWan``): ``random_pair`` of it and our
    ``load_wan_vae``. ``tiny``: base_dim 8, one res block a level (a CPU smoke)."""
    from diffusers import AutoencoderKLWan

    from omniloop.models.autoencoders.wan_vae import load_wan_vae
    from omniloop.models.families.wan.presets import WAN21_VAE

    cfg = dict(WAN21_VAE)
    if tiny:
        cfg.update(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    return random_pair(AutoencoderKLWan, cfg, load_wan_vae, device, dtype, prefix="wan_vae_bench_")
