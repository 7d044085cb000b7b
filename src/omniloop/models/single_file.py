"""Single-file checkpoints as ComfyUI users hold them: one ``.safetensors`` in the original
repository's key layout (Wan, BFL), possibly wrapped (``model.diffusion_model.``) and possibly
stored in ComfyUI's scaled-fp8 form.

Storage forms read here (each tensor is read once, dequantized if needed, then ``cast``):

* fp32 / fp16 / bf16: read as stored, then cast.
* plain fp8 (``*.weight`` in ``float8_e4m3fn``/``float8_e5m2``, no scale): upcast (scale 1).
* ComfyUI scaled fp8, two generations of it:
  - legacy (``*_fp8_scaled.safetensors`` releases): ``<layer>.weight`` in fp8 with a per-layer
    ``<layer>.scale_weight`` (one fp32 value) and a ``scaled_fp8`` marker key;
  - mixed precision (``comfy/ops.py``'s ``MixedPrecisionOps``): a per-layer ``<layer>.comfy_quant``
    (JSON bytes as a uint8 tensor, ``{"format": "float8_e4m3fn"}``) and ``<layer>.weight_scale``.
  Either way the real weight is ``weight.float() * scale``. The input scales (``scale_input``,
  ``input_scale``: ComfyUI's fp8-matmul activation scales) carry no weight and are dropped, as
  is the marker.
* ComfyUI nvfp4 (``comfy_quant`` ``{"format": "nvfp4"}``, the ``*_fp4_mixed`` releases; the
  layout of comfy-kitchen's ``TensorCoreNVFP4Layout``): ``<layer>.weight`` packs two E2M1
  values per uint8 (the even element in the high nibble), rows and columns zero-padded to 16;
  ``<layer>.weight_scale`` holds one float8_e4m3fn scale per 16 values in cuBLAS's block-scale
  tile layout; ``<layer>.weight_scale_2`` one fp32 scale per tensor. The real weight is
  ``e2m1 * (weight_scale_2 * block_scale)`` (fp32), at its padded shape: a layer whose sizes are
  not multiples of 16 then fails the shape check naming it.

Behaviour read from ComfyUI's ``comfy/ops.py`` / ``quant_ops.py`` and comfy-kitchen; the code is ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors import safe_open

from omniloop.models.checkpoint_files import Cast

if TYPE_CHECKING:
    from omniloop.models.model_spec import LoadOptions

# A full ComfyUI checkpoint (``checkpoints/``) holds several components, each under a prefix
# (ComfyUI's ``model.diffusion_model.`` for the DiT, ``vae.`` or ``first_stage_model.`` for the
# VAE, ``text_encoders.*`` ...); a DiT saved by ComfyUI's ``ModelSave`` keeps its prefix too.
DIT_SECTIONS: tuple[str, ...] = ("model.diffusion_model.", "diffusion_model.")
VAE_SECTIONS: tuple[str, ...] = ("vae.", "first_stage_model.")
# a text encoder of a full checkpoint: ``text_encoders.<name>.transformer.`` (ComfyUI's
# ``text_encoder_key_prefix`` + the encoder's name in its CLIP model: clip_l, t5xxl, umt5xxl)
TEXT_SECTION = "text_encoders.{}.transformer."
SCALED_FP8_MARKER = "scaled_fp8"
FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
_SCALE_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".weight_scale_2", ".input_scale",
                   ".comfy_quant")
_WEIGHT_SCALES = ("scale_weight", "weight_scale")  # legacy, mixed precision
_FP8_FORMATS = frozenset({"float8_e4m3fn", "float8_e5m2"})
NVFP4 = "nvfp4"
NVFP4_BLOCK = 16  # values per block scale
# the 16 E2M1 codes (sign bit, 2 exponent bits, 1 mantissa bit) -> their values
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unswizzle_block_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """cuBLAS's block-scale layout -> the [rows, cols] scale matrix. The [rows, cols] matrix,
    zero-padded to multiples of (128, 4), is stored tile by tile (128 rows x 4 columns, row-major
    over tiles); inside a tile, row ``32 * i + j`` column ``c`` sits at ``[j, 4 * i + c]``."""
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    tiles = blocked.reshape(row_tiles, col_tiles, 32, 4, 4)  # [tile row, tile col, j, i, c]
    return tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)[:rows, :cols]


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """[R, C / 2] uint8 (two E2M1 codes a byte, high nibble first) -> [R, C] fp32."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(rows, cols).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes].reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    scales = unswizzle_block_scales(block_scales, rows, cols // NVFP4_BLOCK).to(torch.float32)
    return (values * (tensor_scale.to(torch.float32).reshape(()) * scales).unsqueeze(-1)).reshape(rows, cols)


def _section(keys: set[str], sections: tuple[str, ...]) -> str | None:
    """The prefix of ``sections`` the file's keys carry (the first that any key does), if any."""
    return next((p for p in sections if any(k.startswith(p) for k in keys)), None)


def read_single_file(path: Path, cast: Cast, *, sections: tuple[str, ...],
                     keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The weights of one component in ``path``, dequantized, through ``cast``.

    When the file's keys carry one of ``sections`` (a full checkpoint, or a wrapped DiT) only
    that section is read, its prefix dropped; otherwise the file is the component and every key
    is read. fp8 tensors are upcast to fp32 (times their ``scale_weight`` / ``weight_scale``)
    before ``cast``, so the cast decides the final dtype; a scale whose weight is missing is an
    error, and so is a layer quantized in a format other than fp8 (``comfy_quant``). ``keep``
    (a name without the prefix -> read it?) reads part of a section (LTX-2's text connectors
    ride in its DiT section) without reading the rest.
    """
    sd: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        prefix = _section(keys, sections) or ""
        for key in sorted(keys):
            name = key[len(prefix):]
            if not key.startswith(prefix) or name == SCALED_FP8_MARKER or name.endswith(_SCALE_SUFFIXES):
                continue
            if keep is not None and not keep(name):
                continue
            layer = key[: -len(".weight")] if key.endswith(".weight") else None
            quant = f"{layer}.comfy_quant"
            fmt = json.loads(f.get_tensor(quant).numpy().tobytes()).get("format") \
                if layer is not None and quant in keys else None
            if fmt is not None and fmt not in _FP8_FORMATS | {NVFP4}:
                raise ValueError(f"{path}: layer {name[: -len('.weight')]} is stored as {fmt!r}; only fp8 "
                                 f"({sorted(_FP8_FORMATS)}) and {NVFP4} ComfyUI quantization are dequantized on load")
            tensor = f.get_tensor(key)
            if fmt == NVFP4:
                scales = (f"{layer}.weight_scale", f"{layer}.weight_scale_2")
                if tensor.dtype != torch.uint8 or not all(k in keys for k in scales):
                    raise ValueError(f"{path}: layer {name[: -len('.weight')]} is marked {NVFP4!r} but holds a "
                                     f"{tensor.dtype} weight and scales {[k for k in scales if k in keys]}; an "
                                     "nvfp4 layer packs uint8 codes with weight_scale and weight_scale_2")
                tensor = dequantize_nvfp4(tensor, f.get_tensor(scales[0]), f.get_tensor(scales[1]))
            elif tensor.dtype in FP8_DTYPES:
                tensor = tensor.to(torch.float32)
                for scale_key in (f"{layer}.{suffix}" for suffix in _WEIGHT_SCALES if layer is not None):
                    if scale_key in keys:
                        # [] or [1]: one scale per layer (ComfyUI's per-tensor scaled fp8)
                        tensor = tensor * f.get_tensor(scale_key).to(torch.float32).reshape(())
                        break
            sd[name] = cast(name, tensor)
        orphans = [k for k in keys if k.startswith(prefix) and k.endswith((".scale_weight", ".weight_scale"))
                   and k.rsplit(".", 1)[0] + ".weight" not in keys]
    if orphans:
        raise ValueError(f"{path}: weight scales without their weight: {sorted(orphans)[:8]}; the file is "
                         "truncated or not in ComfyUI's scaled-fp8 layout")
    return sd


def read_original_dit(path: str | Path, cast: Cast, *, marker: str, model: str, layout: str,
                      folder_loader: str) -> dict[str, torch.Tensor]:
    """The tensors of an original-layout DiT file (``read_single_file`` of its DiT section),
    refused with a message naming what to pass when ``path`` is no file or lacks ``marker``
    (the key that tells the layout: diffusers' and ComfyUI's detection read it). ``model`` is
    the family as a user names it ("FLUX.1", "Wan"), ``layout`` the file it must be ("a
    BFL-layout Flux DiT"), ``folder_loader`` the loader of a diffusers ``transformer/`` folder."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a {model} diffusion-model .safetensors file")
    raw = read_single_file(path, cast, sections=DIT_SECTIONS)
    if marker not in raw:
        raise ValueError(f"{path} is not {layout} (no {marker}); pass a {model} diffusion model file, or a "
                         f"diffusers `transformer/` folder to {folder_loader}")
    return raw


class MissingSection(ValueError):
    """A full checkpoint lacks a section a loader reads (``section``: its key prefix)."""

    def __init__(self, path: Path, section: str, what: str) -> None:
        super().__init__(f"{path.name} has no {section!r} section ({what}); pass a checkpoint holding it, or load "
                         "that text encoder from text_encoders/ (CLIPLoader / DualCLIPLoader)")
        self.path, self.section = path, section


def require_text_sections(path: Path, names: tuple[str, ...]) -> None:
    """Raise ``MissingSection`` for the first of the text encoders ``names`` (clip_l, t5xxl)
    whose ``text_encoders.<name>.transformer.`` section ``path`` lacks."""
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    for name in names:
        section = TEXT_SECTION.format(name)
        if _section(keys, (section,)) is None:
            raise MissingSection(path, section, f"the {name} text encoder")


@dataclass(frozen=True, slots=True)
class ComfyCheckpoint:
    """What a family's full ComfyUI checkpoint (``checkpoints/``, ``CheckpointLoaderSimple``)
    holds: ``dit_keys``, keys of its DiT section (without the prefix) that tell the family
    apart, as ComfyUI's model detection reads the DiT's keys; ``text_encoders``, the names of
    its ``text_encoders.<name>.transformer.`` sections in the family's text-encoder order
    (FLUX.1: clip_l, t5xxl; ComfyUI's ``clip_target`` of the model)."""

    dit_keys: tuple[str, ...]
    text_encoders: tuple[str, ...]

    def holds(self, keys: set[str]) -> bool:
        """Whether ``keys`` (a file's) are this family's checkpoint: its DiT keys under a DiT section."""
        return any(all(f"{prefix}{k}" in keys for k in self.dit_keys) for prefix in DIT_SECTIONS)


# -- a model made of single files (the names a workflow's loader nodes give) -----------------

Resolve = Callable[[str, str], Path]  # (folder kind, name) -> a path inside the models folder


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleFileSet:
    """The files one model is made of, by their names in a ComfyUI models folder.

    ``diffusion_models``: one DiT, or a family's two experts in order (Wan2.2 A14B: high
    noise, low noise) with ``boundary_ratio``. ``text_encoders`` in the family's order
    (ComfyUI's ``DualCLIPLoader``: CLIP-L, then T5-XXL). The last four are architecture
    facts the files do not carry; None takes the family's released value (``clip_head_dim``:
    a CLIP text encoder file's attention head width, 64).
    """

    family: str
    diffusion_models: tuple[str, ...] = ()
    vae: str = ""
    text_encoders: tuple[str, ...] = ()
    checkpoint: str | None = None  # a full checkpoint in checkpoints/: the DiT and VAE come from it
    # the text encoders are the checkpoint's text_encoders.<name>.transformer. sections (the
    # family's ComfyCheckpoint.text_encoders, in order; CheckpointLoaderSimple's CLIP), not files
    text_from_checkpoint: bool = False
    # tokenizer folders in text_encoders/, in order, one per text encoder given as a single file
    tokenizers: tuple[str, ...] = ()
    boundary_ratio: float | None = None
    attention_head_dim: int | None = None
    rope_axes: tuple[int, ...] | None = None
    vae_norm_groups: int | None = None
    clip_head_dim: int | None = None
    # a latent upsampler in latent_upscale_models/ (LTX-2's two-stage refine)
    latent_upsampler: str = ""
    # an image encoder in clip_vision/ (CLIPVisionLoader: Wan2.1 I2V / FLF2V's CLIP vision tower)
    # and its head count (not in the file; None: the released 16)
    clip_vision: str = ""
    clip_vision_heads: int | None = None
    # a style model in style_models/ (StyleModelLoader: FLUX.1 Redux's embedder, with a SigLIP clip_vision)
    style_model: str = ""
    # a diffusers folder whose */config.json say the architecture facts the single files do not
    # carry (its weights are not read; diffusers' from_single_file(config=...)); None: the
    # family's released configs
    configs: Path | None = None
    # the workflow edits with a reference image (ComfyUI's ReferenceLatent): a FLUX.1 DiT runs as
    # FLUX.1 Kontext (whose file is a dev-architecture DiT: the workflow, not the file, says so)
    reference_edit: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint is not None:
            if self.diffusion_models or self.vae or not self.checkpoint:
                raise ValueError("checkpoint names one file in checkpoints/ holding the DiT and VAE; pass it alone, "
                                 "or diffusion_models and vae without it")
        elif not self.diffusion_models or not all(self.diffusion_models) or not self.vae:
            raise ValueError("diffusion_models must name at least one file in diffusion_models/ and vae one in vae/ "
                             "(or pass checkpoint: a full checkpoint in checkpoints/)")
        if self.text_from_checkpoint and (self.checkpoint is None or self.text_encoders):
            raise ValueError("text_from_checkpoint reads the text encoders from the checkpoint's sections: pass "
                             "checkpoint and no text_encoders (tokenizers: one folder per section)")
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1) (e.g. 0.875); got {self.boundary_ratio}")


    def dit_paths(self, resolve: Resolve) -> list[Path]:
        if self.checkpoint is not None:
            return [resolve("checkpoints", self.checkpoint)]
        return [resolve("diffusion_models", name) for name in self.diffusion_models]

    def vae_path(self, resolve: Resolve) -> Path:
        return resolve("checkpoints", self.checkpoint) if self.checkpoint is not None else resolve("vae", self.vae)


# (files, resolve, load options) -> (the model_index a diffusers folder would have, components)
SingleFileLoader = Callable[[SingleFileSet, Resolve, "LoadOptions"], tuple[dict[str, Any], dict[str, Any]]]


# ComfyUI keeps a SentencePiece tokenizer's model inside the text encoder file (its
# ``tokenizer_data``): the serialized model proto as a uint8 tensor
TOKENIZER_KEY = "spiece_model"


def carries_tokenizer(path: Path) -> bool:
    """Whether the single file ``path`` holds its tokenizer (``spiece_model``)."""
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        return TOKENIZER_KEY in f.keys()


@dataclass(frozen=True, slots=True)
class TextEncoderSource:
    """Where one text encoder's weights and tokenizer are: one transformers-layout folder
    holding both (``tokenizer == weights``), a single weights file and a tokenizer folder, or a
    single file holding its tokenizer too (``tokenizer == weights``, a file: ``spiece_model``)."""

    weights: Path
    tokenizer: Path

    @property
    def single_file(self) -> bool:
        return self.weights.is_file()

    @property
    def tokenizer_in_file(self) -> bool:
        return self.single_file and self.tokenizer == self.weights


def text_encoder_sources(files: SingleFileSet, resolve: Resolve, *, file_tokenizers: bool = False,
                         checkpoint: ComfyCheckpoint | None = None) -> list[TextEncoderSource]:
    """The text encoders of ``files`` in order; single files take the ``tokenizers`` in order.
    ``file_tokenizers`` (the family's loader reads a file's own SentencePiece tokenizer): a
    file that carries one uses it when no tokenizer folder is left for it. ``checkpoint``: the
    family's full-checkpoint sections, read when ``files.text_from_checkpoint`` (each source is
    then the checkpoint file, whose loader reads its own section; a missing section raises
    ``MissingSection``)."""
    if files.text_from_checkpoint:
        return _checkpoint_text_sources(files, resolve, checkpoint)
    tokenizers = list(files.tokenizers)
    sources = []
    for name in files.text_encoders:
        path = resolve("text_encoders", name)
        if path.is_dir():
            sources.append(TextEncoderSource(path, path))
            continue
        if not tokenizers and file_tokenizers and carries_tokenizer(path):
            sources.append(TextEncoderSource(path, path))
            continue
        if not tokenizers:
            raise ValueError(f"text encoder {name!r} is a single file and carries no tokenizer; pass tokenizers: a "
                             "tokenizer folder in text_encoders/ for each text encoder given as a file")
        sources.append(TextEncoderSource(path, resolve("text_encoders", tokenizers.pop(0))))
    if tokenizers:
        raise ValueError(f"tokenizers {list(files.tokenizers)} name more folders than there are text encoders given "
                         "as single files; drop the extra ones")
    return sources


def _checkpoint_text_sources(files: SingleFileSet, resolve: Resolve,
                             checkpoint: ComfyCheckpoint | None) -> list[TextEncoderSource]:
    assert files.checkpoint is not None
    if checkpoint is None:
        raise ValueError(f"family {files.family!r} reads no text encoders from a full checkpoint; load them from "
                         "text_encoders/ (text_encoders=...)")
    names = checkpoint.text_encoders
    if len(files.tokenizers) != len(names):
        raise ValueError(f"the checkpoint's text encoders {list(names)} need one tokenizer folder each, in that "
                         f"order; got tokenizers={list(files.tokenizers)}")
    path = resolve("checkpoints", files.checkpoint)
    require_text_sections(path, names)
    return [TextEncoderSource(path, resolve("text_encoders", tokenizer)) for tokenizer in files.tokenizers]
