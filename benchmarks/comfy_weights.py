"""A ComfyUI models folder of random weights that ComfyUI itself and omniloop both load: the
files ``flux_dev_full_text_to_image`` names, in their original key layouts (BFL's
``flux1-dev`` and ``ae``, transformers' CLIP-L and T5-XXL as ComfyUI ships them)::

    DIR/diffusion_models/flux1-dev.safetensors   BFL keys (double_blocks.*, single_blocks.*, img_in ...)
    DIR/vae/ae.safetensors                       LDM keys (encoder.down.*, decoder.up.*)
    DIR/text_encoders/clip_l.safetensors         text_model.* + text_projection / logit_scale
    DIR/text_encoders/t5xxl_fp16.safetensors     encoder.block.* + shared (one copy of the tied embedding)
    DIR/text_encoders/{clip_l,t5xxl_fp16}_tokenizer/   tokenizer folders (omniloop's single-file
                                                 text encoders need one; ComfyUI ships its own and lists no
                                                 folder without weight files)

The key names come from the inverse key maps our single-file tests use
(``tests/models/comfy/original_layout.py``), applied to the diffusers-named modules built on the
meta device: no weight is made twice. Each tensor is then drawn from its own seeded generator
and streamed to disk one at a time (a safetensors header first, then the bytes in header order),
so the 12B DiT never sits in memory, not even once (``device="cuda"`` draws on the GPU: the
34 GB of the full size in about a minute instead of several).

Sizes (``SIZES``):

* ``full``: FLUX.1-dev (19 + 38 blocks, width 3072, 11.9B), the FLUX.1 VAE, CLIP-L, T5-XXL
  (4.76B) -- the published architectures, for the GPU run (~34 GB in bf16).
* ``comfy-tiny``: what ComfyUI can still run on a CPU. Its model detection reads a Flux DiT's
  width, input widths and depth from the tensor shapes but fixes 24 heads and rope axes
  (16, 56, 56), so the width stays 3072 with one double and one single block (0.54B); its VAE
  (``comfy/sd.py``: ch 128, ch_mult 1-2-4-4), CLIP-L (``sd1_clip_config.json``) and T5-XXL
  (``t5_config_xxl.json``) configs are fixed, so they are full size (a file with fewer layers
  would leave ComfyUI's other layers uninitialized).
* ``tiny``: toy widths everywhere (omniloop and diffusers read every size from the files; ComfyUI
  cannot run it), for tests.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parent.parent
for _path in (_ROOT, _ROOT / "benchmarks"):  # the inverse key maps live with the single-file tests
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from flux_random import _tokenizers as toy_tokenizers  # noqa: E402

DIT, VAE, CLIP, T5 = ("diffusion_models/flux1-dev.safetensors", "vae/ae.safetensors",
                      "text_encoders/clip_l.safetensors", "text_encoders/t5xxl_fp16.safetensors")
TOKENIZERS = ("text_encoders/clip_l_tokenizer", "text_encoders/t5xxl_fp16_tokenizer")
SIZES = ("full", "comfy-tiny", "tiny")
# ComfyUI's own tokenizer folders (data files of its source tree, copied at run time, never committed)
COMFYUI_TOKENIZERS = ("comfy/sd1_tokenizer", "comfy/text_encoders/t5_tokenizer")
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class FolderSize:
    """The four architectures of one size (diffusers / transformers config keys)."""

    dit: dict[str, Any]
    vae: dict[str, Any]
    clip: dict[str, Any]
    t5: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)  # SingleFileSet facts the files do not carry


def folder_size(size: str) -> FolderSize:
    from omniloop.models.families.flux.presets import FLUX1_DEV, FLUX1_VAE

    # CLIP-L as ComfyUI's sd1_clip_config.json; T5-XXL encoder as its t5_config_xxl.json
    clip_l = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                  bos_token_id=0, eos_token_id=49407, pad_token_id=1)
    t5_xxl = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                  relative_attention_num_buckets=32, dropout_rate=0.0, feed_forward_proj="gated-gelu")
    if size == "full":
        return FolderSize(dict(FLUX1_DEV), dict(FLUX1_VAE), clip_l, t5_xxl)
    if size == "comfy-tiny":
        return FolderSize(dict(FLUX1_DEV, num_layers=1, num_single_layers=1), dict(FLUX1_VAE), clip_l, t5_xxl)
    if size == "tiny":  # benchmarks/flux_random.py's toy DiT and VAE; CLIP heads 64 wide (the loader's default)
        dit = dict(FLUX1_DEV, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=128, axes_dims_rope=(4, 6, 6))
        vae = dict(FLUX1_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4,
                   norm_num_groups=4)
        clip = dict(clip_l, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2)
        t5 = dict(t5_xxl, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
        return FolderSize(dit, vae, clip, t5, facts={"rope_axes": (4, 6, 6), "vae_norm_groups": 4})
    raise ValueError(f"size={size!r}; pass one of {SIZES}")


# -- names and shapes: the inverse key maps over meta modules ---------------------------------
Shapes = dict[str, tuple[int, ...]]


def _shapes(sd: dict[str, torch.Tensor]) -> Shapes:
    return {k: tuple(v.shape) for k, v in sd.items()}


def dit_shapes(config: dict[str, Any]) -> Shapes:
    from omniloop.models.families.flux.model import FluxConfig, FluxTransformer
    from tests.models.comfy.original_layout import flux_dit_original

    with torch.device("meta"):
        model = FluxTransformer(FluxConfig(**config))
    return _shapes(flux_dit_original(model.state_dict()))


def vae_shapes(config: dict[str, Any]) -> Shapes:
    from omniloop.models.autoencoders.kl2d import KL2DAutoencoder, KL2DConfig
    from tests.models.comfy.original_layout import kl_vae_original

    with torch.device("meta"):
        model = KL2DAutoencoder(KL2DConfig(**config))
    return _shapes(kl_vae_original(model.state_dict(), levels=len(config["block_out_channels"])))


def clip_shapes(config: dict[str, Any]) -> Shapes:
    """ComfyUI's clip_l file: the text model under ``text_model.``, the projection and logit
    scale beside it (tests/models/comfy/test_clip_single_file.py's layout)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        model = CLIPTextModel(CLIPTextConfig(**config))
    width = config["hidden_size"]
    shapes = {f"text_model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes | {"text_projection.weight": (width, width), "logit_scale": ()}


def t5_shapes(config: dict[str, Any]) -> Shapes:
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        model = T5EncoderModel(T5Config(**config))
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}


# -- values -----------------------------------------------------------------------------------
# output projections of the residual branches (original names): small, as trained models have,
# so a deep random stack stays finite in bf16 (benchmarks/flux_random.py does the same)
_SMALL = re.compile(r"(img_attn\.proj|txt_attn\.proj|img_mlp\.2|txt_mlp\.2|linear2|final_layer\.linear|"
                    r"SelfAttention\.o|DenseReluDense\.wo|out_proj|fc2)\.weight$")


def random_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                  device: str = "cpu") -> torch.Tensor:
    """One tensor of the file, from its own generator (seed, key): the same bytes on every
    machine and in any order. Norm scales 1, biases 0, embeddings N(0, 1) (T5) / N(0, 0.02)
    (CLIP), weights N(0, 1/fan_in), residual output projections a tenth of that."""
    if key == "logit_scale":
        return torch.tensor(4.6052, dtype=dtype)
    if len(shape) == 1 and re.search(r"(norm|scale|gamma|layer_norm)", key) and key.endswith(("weight", "scale", "gamma")):
        return torch.ones(shape, dtype=dtype)
    if len(shape) == 1 and key.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    # (a CUDA generator draws other numbers than the CPU's: both servers read the file, not the draw)
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**62)
    if key.endswith(("shared.weight", "relative_attention_bias.weight")):
        std = 1.0 if key.endswith("shared.weight") else 0.1
    elif "embedding" in key:
        std = 0.02
    else:
        fan_in = 1
        for n in shape[1:]:
            fan_in *= n
        std = (1.0 / max(fan_in, 1)) ** 0.5 * (0.1 if _SMALL.search(key) else 1.0)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=device).mul_(std).to(dtype).cpu()


def write_random_safetensors(path: Path, shapes: Shapes, dtype: torch.dtype, seed: int, device: str = "cpu") -> int:
    """Stream a safetensors file of ``shapes`` (random, ``random_tensor``) tensor by tensor:
    the header with every offset first (the format: 8-byte little-endian header length, the
    JSON header padded to 8 bytes, the tensors' bytes in offset order). -> bytes written."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "written_by": "omniloop benchmarks/comfy_weights.py"}}
    offset = 0
    for key, shape in shapes.items():
        n = itemsize
        for d in shape:
            n *= d
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, shape in shapes.items():
            tensor = random_tensor(key, shape, dtype, seed, device).contiguous()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
            del tensor
    return 8 + len(raw) + offset


def write_tokenizers(root: Path, comfyui_root: Path | None) -> str:
    """The tokenizer folders omniloop's single-file text encoders read: ComfyUI's own (the
    same token ids on both sides) when its source is at ``comfyui_root``, else the benchmark's
    toy tokenizers (benchmarks/flux_random.py). -> which."""
    targets = [root / t for t in TOKENIZERS]
    if comfyui_root is not None:
        for source, target in zip(COMFYUI_TOKENIZERS, targets):
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(Path(comfyui_root) / source, target)
        # ComfyUI chunks CLIP prompts itself (its config says 8192); the released CLIP-L tokenizer
        # (openai/clip-vit-large-patch14, the one it copies) says 77, the encoder's positions
        config = targets[0] / "tokenizer_config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"model_max_length": 77}, indent=2))
        return "comfyui"
    for tokenizer, target in zip(toy_tokenizers(), targets):
        tokenizer.save_pretrained(target)
    return "toy"


def write_flux_folder(root: Path, size: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      comfyui_root: Path | None = None, device: str = "cpu") -> dict[str, Any]:
    """Write the four files of ``size`` and the tokenizer folders under ``root`` (a ComfyUI
    models folder); -> a record (sizes in bytes, the SingleFileSet facts the files do not carry)."""
    arch = folder_size(size)
    files = {DIT: dit_shapes(arch.dit), VAE: vae_shapes(arch.vae), CLIP: clip_shapes(arch.clip), T5: t5_shapes(arch.t5)}
    written = {}
    for rel, shapes in files.items():
        written[rel] = write_random_safetensors(root / rel, shapes, dtype, seed, device)
    tokenizers = write_tokenizers(root, comfyui_root)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "bytes": written, "tokenizers": tokenizers,
            "facts": arch.facts}
