"""Tiny random Cosmos3 checkpoints built and saved with the public implementations (the
test-only oracles): diffusers' ``Cosmos3OmniPipeline`` folder (transformer, Wan2.2 VAE with
z_dim 48 and patchify, AVAE sound tokenizer, UniPC scheduler, a chat tokenizer) and the
unified checkpoint transformers' ``Cosmos3OmniForConditionalGeneration`` (the reasoner)
loads from: the transformer's flat safetensors plus a ``Cosmos3OmniConfig``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{%- endif %}{%- endfor %}"
    "{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CORPUS = [
    "You are a helpful assistant who will generate videos from a give prompt.",
    "You are a helpful assistant who will generate images from a give prompt.",
    "a red circle moving right", "The video is 2.0 seconds long and is of 24 FPS.",
    "This video is of 64x64 resolution.", "This image is not of 64x64 resolution.",
    "a robot arm picks up a cube", "the cat sat on the mat", "hello world",
    '{"actions": [{"time": "0:00-0:00", "description": "pick"}], "duration": "0s"}',
]
# Tiny published-shaped transformer: the diffusers defaults at toy width (head_dim 16 -> mRoPE 4/2/2).
TRANSFORMER = dict(
    head_dim=16, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
    num_hidden_layers=2, latent_channel=48, latent_patch_size=2, patch_latent_dim=48 * 4, rope_axes_dim=[4, 2, 2],
    rope_theta=5000000.0, base_fps=24, enable_fps_modulation=True, unified_3d_mrope_temporal_modality_margin=15000,
)
SOUND = dict(sound_gen=True, sound_dim=8, sound_latent_fps=25.0)
ACTION = dict(action_gen=True, action_dim=12, num_embodiment_domains=32)
VAE = dict(
    base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
    is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[0.01 * i for i in range(48)], latents_std=[1.0 + 0.02 * i for i in range(48)],
)
# 8 kHz (an AAC-encodable rate), 80 samples a latent frame: 38 sound tokens for 9 frames at 24 fps
AUDIO = dict(
    sampling_rate=8000, vocoder_input_dim=8, dec_dim=4, dec_c_mults=(1, 2), dec_strides=(8, 10), dec_out_channels=2,
    enc_dim=4, enc_num_blocks=1, enc_n_fft=8, enc_hop_length=2, enc_latent_dim=16, enc_c_mults=(1, 1),
    enc_strides=(4, 10),
)
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, num_train_timesteps=1000,
                 solver_order=2)


def tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_pipeline(*, sound: bool = True, action: bool = True, seed: int = 0, **transformer: Any):
    """A random tiny ``Cosmos3OmniPipeline`` (fp32, CPU)."""
    from diffusers import AutoencoderKLWan, Cosmos3AVAEAudioTokenizer, Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from diffusers import UniPCMultistepScheduler
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_tokenizer(Path(tmp))
    torch.manual_seed(seed)
    config = {**TRANSFORMER, "vocab_size": len(tokenizer), **(SOUND if sound else {}), **(ACTION if action else {}), **transformer}
    model = Cosmos3OmniTransformer(**config).eval()
    with torch.no_grad():  # random weights at a scale that makes every path matter (diffusers inits zeros/ones)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or "layernorm" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    vae = AutoencoderKLWan(**VAE).eval()
    sound_tok = Cosmos3AVAEAudioTokenizer(**AUDIO).eval() if sound else None
    scheduler = UniPCMultistepScheduler(**SCHEDULER)
    return Cosmos3OmniPipeline(transformer=model, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                               sound_tokenizer=sound_tok, safety_checker=None, enable_safety_checker=False)


def save_pipeline(folder: Path, **kwargs: Any):
    pipe = build_pipeline(**kwargs)
    pipe.save_pretrained(folder)
    return pipe


def reasoner_config(transformer_config: dict[str, Any], vocab_size: int, eos_id: int) -> dict[str, Any]:
    """The ``Cosmos3OmniConfig`` dict (Qwen3-VL text config) of the transformer's und pathway."""
    c = transformer_config
    text = {
        "model_type": "qwen3_vl_text", "vocab_size": vocab_size, "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"], "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_theta"],
                            "mrope_section": list(c["rope_axes_dim"]), "mrope_interleaved": True},
    }
    vision = {"model_type": "qwen3_vl_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": c["hidden_size"], "patch_size": 4, "temporal_patch_size": 2,
              "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    return {"architectures": ["Cosmos3OmniForConditionalGeneration"], "model_type": "cosmos3_omni",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "eos_token_id": eos_id}


def save_unified(pipeline_dir: Path, folder: Path, *, vision: bool = False) -> Path:
    """The unified checkpoint: the transformer's flat safetensors (generator keys included)
    + a Cosmos3OmniConfig + the tokenizer, as the reasoner loads it. ``vision``: also a
    random Qwen3-VL ViT under its flat keys (``blocks.*``, ``merger.*``, ...) and the image
    processor config (``preprocessor_config.json``), as the published checkpoint carries."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(pipeline_dir / "transformer" / "diffusion_pytorch_model.safetensors", folder / "model.safetensors")
    for f in (pipeline_dir / "text_tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    tconf = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    cfg = reasoner_config(tconf, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    cfg.update({f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
                for name in ("image_pad", "video_pad", "vision_start", "vision_end")})
    cfg["image_token_id"], cfg["video_token_id"] = cfg.pop("image_pad_token_id"), cfg.pop("video_pad_token_id")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if vision:
        _save_vit(folder, cfg["vision_config"])
    return folder


def _save_vit(folder: Path, vision_config: dict[str, Any], seed: int = 5) -> None:
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    torch.manual_seed(seed)
    vit = Qwen3VLVisionModel._from_config(config).eval()
    with torch.no_grad():  # a scale at which the image changes the answer
        g = torch.Generator().manual_seed(seed)
        for p in vit.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    tensors = load_file(folder / "model.safetensors")
    tensors.update({k: v.contiguous() for k, v in vit.state_dict().items()})
    save_file(tensors, folder / "model.safetensors")
    # 4-pixel patches merged 2x2: an image becomes (h/8) x (w/8) tokens, 16x16 .. 64x64 pixels
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                             max_pixels=64 * 64).save_pretrained(folder)
    # Qwen3VLVideoProcessor's config at these patch sizes (the class itself needs torchvision)
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 4, "temporal_patch_size": 2,
             "merge_size": 2, "size": {"shortest_edge": 16 * 16, "longest_edge": 4 * 64 * 64}, "fps": 2,
             "min_frames": 4, "max_frames": 768, "do_sample_frames": True, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
