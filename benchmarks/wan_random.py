"""Random-weight Wan checkpoints in the diffusers layout, for benchmarks (diffusers and
transformers build and save them; omniloop loads them like any user checkpoint)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

CORPUS = ["a red circle moving right", "a blue square moving left", "a green triangle bouncing", "low quality"]


SIZES = ("full", "small", "tiny")


def save_random_wan(folder: Path | None = None, *, size: str, device: str = "cpu") -> Path:
    """``size``: "full" = the Wan2.1-T2V-1.3B architecture (30 blocks) with the real VAE;
    "small" = 8 blocks of width 128; "tiny" = the 2-block toy (both with a small VAE)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    from omniloop.models.families.wan.presets import WAN21_T2V_1_3B, WAN21_VAE

    folder = Path(folder or tempfile.mkdtemp(prefix="wan_random_"))
    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(CORPUS * 20, vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tokenizer = T5TokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
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
        text = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=dit["text_dim"], d_kv=8, d_ff=64, num_layers=1,
                                           num_heads=4, relative_attention_num_buckets=8))
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text, vae=AutoencoderKLWan(**vae),
                           transformer=WanTransformer3DModel(**dit),
                           scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=3.0))
        pipe.save_pretrained(folder)
    return folder
