"""Native Wan DiT == diffusers' WanTransformer3DModel (the test-only oracle), on CPU.

Each case saves a tiny random diffusers checkpoint, loads it both with diffusers and with
``load_wan_dit`` from the same folder (diffusers' loaded weights can differ from its
in-memory init by ~5e-7, so the oracle is the loaded model), and compares forwards.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from omniloop.models.families.wan.model import WanDiT, WanDiTConfig
from omniloop.models.families.wan.weights import WEIGHTS_FILE, dit_state_dict_from_diffusers, load_wan_dit
from omniloop.models.layers.attention import set_attention_backend
from tests.factories import save_tiny_wan_dit, tiny_wan_dit_config

diffusers = pytest.importorskip("diffusers")

# Measured 0 (bit-equal) in every case here, sdpa vs math 4.8e-7; the bound allows the
# ~5e-7 that differently aligned loaded weights can cost a forward (ARCHITECTURE.md).
FP32_ATOL = 2e-6
# bf16: both models round to bf16 at the same places. T2V agrees exactly; Wan2.1 I2V is one
# bf16 ulp off (1.6e-2 at |out| ~ 2.4) because diffusers feeds its k/v Linears non-contiguous
# slices of the concatenated [image | text] context and CPU bf16 GEMMs round those differently
# (ours get contiguous tensors). The bound allows that ulp; the second check in the test is
# that our distance to the fp32 oracle is no worse than diffusers' own.
BF16_ATOL = 2e-2
# diffusers' WanAttnProcessor splits image tokens off the context assuming 512 text tokens.
WAN21_TEXT_LEN = 512


@dataclass(frozen=True)
class Case:
    """One parity case: checkpoint config overrides and the forward's input shapes."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    batch: int = 1
    latent: tuple[int, int, int] = (3, 6, 10)  # F, H, W: non-square, odd token grid 3x3x5
    text_len: int = 7
    image_tokens: int | None = None  # CLIP tokens per image (Wan2.1 I2V / FLF2V)
    per_token_timestep: bool = False


CASES = [
    Case("t2v"),
    Case("t2v_batch2_different_text", batch=2),
    Case("t2v_per_token_timesteps_batch2", batch=2, per_token_timestep=True),
    Case("i2v_wan22_latent_concat", {"in_channels": 36, "out_channels": 16}),
    Case(
        "i2v_wan21_added_kv",
        {"image_dim": 24, "added_kv_proj_dim": 32},
        batch=2,
        text_len=WAN21_TEXT_LEN,
        image_tokens=5,
    ),
    Case(
        "flf2v_wan21_pos_embed",
        {"image_dim": 24, "added_kv_proj_dim": 32, "pos_embed_seq_len": 10},
        text_len=WAN21_TEXT_LEN,
        image_tokens=5,
    ),
    Case("image_tokens_in_text_context", {"image_dim": 24}, image_tokens=4),
    Case("no_cross_attn_norm_head_dim_12", {"cross_attn_norm": False, "attention_head_dim": 12}),
    Case("patch_2x2x2", {"patch_size": (2, 2, 2)}, latent=(4, 6, 10)),
]


def _inputs(case: Case, seed: int = 1) -> dict[str, torch.Tensor]:
    cfg = tiny_wan_dit_config(**case.overrides)
    g = torch.Generator().manual_seed(seed)
    f, h, w = case.latent
    pt, ph, pw = cfg["patch_size"]
    inputs = {
        "hidden_states": torch.randn(case.batch, cfg["in_channels"], f, h, w, generator=g),
        "encoder_hidden_states": torch.randn(case.batch, case.text_len, cfg["text_dim"], generator=g),
    }
    if case.per_token_timestep:
        tokens = (f // pt) * (h // ph) * (w // pw)
        # Wan2.2 TI2V style: first-frame tokens at t=0, the rest at the sample's t
        t = torch.tensor([700.0, 250.0])[: case.batch, None].repeat(1, tokens)
        t[:, : (h // ph) * (w // pw)] = 0.0
        inputs["timestep"] = t
    else:
        inputs["timestep"] = torch.tensor([700.0, 250.0])[: case.batch]
    if case.image_tokens is not None:
        images = case.batch * (2 if cfg["pos_embed_seq_len"] else 1)
        inputs["encoder_hidden_states_image"] = torch.randn(images, case.image_tokens, cfg["image_dim"], generator=g)
    return inputs


def _diffusers_forward(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0]


def _cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v if k == "timestep" else v.to(dtype)) for k, v in inputs.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved tiny checkpoint per case (plus the shared T2V one), built once per module."""
    root = tmp_path_factory.mktemp("wan_dit")
    return {case.name: save_tiny_wan_dit(root / case.name, **case.overrides) for case in CASES}


def _load_pair(folder: Path, dtype: torch.dtype) -> tuple[nn.Module, WanDiT]:
    reference = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype).eval()
    return reference, load_wan_dit(folder, device="cpu", dtype=dtype)


# --------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@torch.no_grad()
def test_fp32_parity(case: Case, checkpoints: dict[str, Path]) -> None:
    reference, ours = _load_pair(checkpoints[case.name], torch.float32)
    inputs = _inputs(case)
    expected = _diffusers_forward(reference, inputs)
    actual = ours(**inputs)
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    print(f"[fp32 parity] {case.name}: max abs err {err:.3e} (|out| max {expected.abs().max().item():.2f})")
    assert err <= FP32_ATOL


@pytest.mark.parametrize("name", ["t2v_per_token_timesteps_batch2", "i2v_wan21_added_kv"])
@torch.no_grad()
def test_bf16_tracks_diffusers(name: str, checkpoints: dict[str, Path]) -> None:
    case = next(c for c in CASES if c.name == name)
    inputs = _inputs(case)
    reference32, _ = _load_pair(checkpoints[name], torch.float32)
    reference, ours = _load_pair(checkpoints[name], torch.bfloat16)
    # Same fp32 islands as diffusers (time embedder, scale_shift_tables, norm2 affine).
    ours_fp32 = {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    ref_fp32 = {n for n, p in reference.named_parameters() if p.dtype == torch.float32}
    assert len(ours_fp32) == len(ref_fp32) > 0
    truth = _diffusers_forward(reference32, inputs)
    expected = _diffusers_forward(reference, _cast(inputs, torch.bfloat16)).float()
    actual = ours(**_cast(inputs, torch.bfloat16))
    assert actual.dtype == torch.bfloat16
    err = (actual.float() - expected).abs().max().item()
    ours_vs_fp32 = (actual.float() - truth).abs().max().item()
    theirs_vs_fp32 = (expected - truth).abs().max().item()
    print(f"[bf16] {name}: vs diffusers-bf16 {err:.3e}; vs fp32 oracle: ours {ours_vs_fp32:.3e}, "
          f"diffusers {theirs_vs_fp32:.3e}")
    assert err <= BF16_ATOL
    assert ours_vs_fp32 <= 1.25 * theirs_vs_fp32 + 1e-3


@torch.no_grad()
def test_model_cast_wholesale_to_bf16_runs_as_diffusers_does(checkpoints: dict[str, Path]) -> None:
    """``model.to(torch.bfloat16)`` puts the time embedder in bf16 too (no fp32 islands): diffusers
    casts the fp32 sinusoid to the embedder's dtype, and so do we (a Float/BFloat16 matmul error before)."""
    case = next(c for c in CASES if c.name == "t2v_per_token_timesteps_batch2")
    reference, ours = _load_pair(checkpoints[case.name], torch.float32)
    reference, ours = reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    assert ours.time_embedder.linear_1.weight.dtype == torch.bfloat16
    inputs = _cast(_inputs(case), torch.bfloat16)  # timesteps stay fp32, as the denoiser passes them
    expected = _diffusers_forward(reference, inputs).float()
    actual = ours(**inputs)
    err = (actual.float() - expected).abs().max().item()
    print(f"[bf16 wholesale] vs diffusers cast the same way: max abs err {err:.3e}")
    assert actual.dtype == torch.bfloat16 and err <= BF16_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_per_frame_timesteps_equal_per_token_ones_bit_for_bit(dtype: torch.dtype, checkpoints: dict[str, Path]) -> None:
    """Wan2.2 TI2V timesteps per latent frame ([B, F']: the adaLN modulation computed once per
    frame and broadcast over its tokens) give exactly the output of the per-token timesteps that
    diffusers takes ([B, L], every token of a frame at its frame's t), and diffusers' output."""
    case = CASES[2]
    inputs = _cast(_inputs(case), dtype)
    per_token = inputs["timestep"]  # [2, L]: the first frame's tokens at 0
    frame_tokens = per_token.shape[1] // case.latent[0]
    per_frame = per_token[:, ::frame_tokens]  # [2, F']
    assert torch.equal(per_frame.repeat_interleave(frame_tokens, dim=1), per_token)
    reference, ours = _load_pair(checkpoints[case.name], dtype)
    got = ours(**{**inputs, "timestep": per_frame})
    assert torch.equal(got, ours(**inputs))
    assert torch.equal(got, _diffusers_forward(reference, inputs))


# --------------------------------------------------------------------------------------
# Runtime hooks: attention backends, block interceptor, compile, purity
# --------------------------------------------------------------------------------------


@torch.no_grad()
def test_attention_backends_agree(checkpoints: dict[str, Path]) -> None:
    case = CASES[4]  # Wan2.1 I2V: self-, text- and image-attention all dispatch through the backend
    ours = load_wan_dit(checkpoints[case.name], dtype=torch.float32)
    inputs = _inputs(case)
    set_attention_backend(ours, "sdpa")
    sdpa = ours(**inputs)
    set_attention_backend(ours, "math")
    backends = {m.attention_backend for m in ours.modules() if hasattr(m, "attention_backend")}
    assert backends == {"math"} and sum(hasattr(m, "attention_backend") for m in ours.modules()) == 4
    math_out = ours(**inputs)
    assert (sdpa - math_out).abs().max().item() <= FP32_ATOL


class RecordingInterceptor:
    """Runs every block through ``call`` and records the order."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def run(self, blocks: Sequence[nn.Module], hidden: torch.Tensor, call: Any) -> torch.Tensor:
        for index in range(len(blocks)):
            self.calls.append(index)
            hidden = call(index, hidden)
        return hidden


class SkipAllInterceptor:
    def run(self, blocks: Sequence[nn.Module], hidden: torch.Tensor, call: Any) -> torch.Tensor:
        return hidden


@torch.no_grad()
def test_block_interceptor_is_used(checkpoints: dict[str, Path]) -> None:
    ours = load_wan_dit(checkpoints["t2v"], dtype=torch.float32)
    inputs = _inputs(CASES[0])
    plain = ours(**inputs)
    recorder = RecordingInterceptor()
    assert torch.equal(ours(**inputs, block_interceptor=recorder), plain)
    assert recorder.calls == [0, 1]
    assert not torch.equal(ours(**inputs, block_interceptor=SkipAllInterceptor()), plain)


@torch.no_grad()
def test_forward_is_pure_and_compiles_without_graph_breaks(checkpoints: dict[str, Path]) -> None:
    ours = load_wan_dit(checkpoints["t2v_per_token_timesteps_batch2"], dtype=torch.float32)
    inputs = _inputs(CASES[2])

    def module_attrs() -> list[set[str]]:
        return [set(vars(m)) for m in ours.modules()]

    before = module_attrs()
    first = ours(**inputs)
    assert module_attrs() == before, "forward stored state on the module"
    compiled = torch.compile(ours, backend="eager", fullgraph=True)  # fullgraph: fails on any graph break
    assert torch.equal(compiled(**inputs), first)


# --------------------------------------------------------------------------------------
# Loading: sharded checkpoints, key mapping, errors
# --------------------------------------------------------------------------------------


@torch.no_grad()
def test_sharded_checkpoint_loads_same_weights(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    sharded = save_tiny_wan_dit(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    single = load_wan_dit(checkpoints["t2v"], dtype=torch.float32).state_dict()
    loaded = load_wan_dit(sharded, dtype=torch.float32).state_dict()
    assert single.keys() == loaded.keys()
    assert all(torch.equal(single[k], loaded[k]) for k in single)


def test_key_mapping_covers_model_and_leaves_input_untouched(checkpoints: dict[str, Path]) -> None:
    folder = checkpoints["i2v_wan21_added_kv"]
    source = load_file(folder / WEIGHTS_FILE)
    source["blocks.0.attn2.norm_added_q.weight"] = torch.ones(32)  # ignored, as in diffusers
    before = dict(source)
    mapped = dit_state_dict_from_diffusers(source)
    assert source.keys() == before.keys()
    config = WanDiTConfig.from_diffusers_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = WanDiT(config)
    assert mapped.keys() == model.state_dict().keys()
    qkv = mapped["blocks.1.self_attn.qkv.weight"]
    expected = torch.cat([source[f"blocks.1.attn1.to_{p}.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


@pytest.mark.parametrize(
    "drop, message",
    [
        ("blocks.1.attn1.norm_q.weight", "blocks.1.self_attn.norm_q.weight"),  # a renamed key
        ("blocks.0.attn1.to_k.bias", "blocks.0.attn1.to_k.bias"),  # one part of a fused qkv
    ],
)
def test_missing_key_names_folder_and_key(
    tmp_path: Path, checkpoints: dict[str, Path], drop: str, message: str
) -> None:
    folder = _copy_checkpoint(checkpoints["t2v"], tmp_path / "broken")
    sd = load_file(folder / WEIGHTS_FILE)
    del sd[drop]
    save_file(sd, folder / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=re.escape(str(folder))) as info:
        load_wan_dit(folder, dtype=torch.float32)
    assert message in str(info.value)


def test_unexpected_key_is_listed(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    folder = _copy_checkpoint(checkpoints["t2v"], tmp_path / "extra")
    sd = load_file(folder / WEIGHTS_FILE)
    sd["blocks.0.mystery.weight"] = torch.zeros(3)
    save_file(sd, folder / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=r"unexpected keys \[blocks\.0\.mystery\.weight\]"):
        load_wan_dit(folder, dtype=torch.float32)


def test_unknown_config_key_is_rejected(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    folder = _copy_checkpoint(checkpoints["t2v"], tmp_path / "badcfg")
    config = json.loads((folder / "config.json").read_text())
    assert "_class_name" in config and "_diffusers_version" in config  # metadata is accepted
    config["vace_layers"] = [0, 1]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown WanTransformer3DModel config keys \\['vace_layers'\\]"):
        load_wan_dit(folder, dtype=torch.float32)


@pytest.mark.parametrize("remove", ["config.json", WEIGHTS_FILE])
def test_missing_file_is_named(tmp_path: Path, checkpoints: dict[str, Path], remove: str) -> None:
    folder = _copy_checkpoint(checkpoints["t2v"], tmp_path / "partial")
    (folder / remove).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(folder / remove))):
        load_wan_dit(folder, dtype=torch.float32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_head_dim": 13}, "cannot be split into 3D RoPE axes"),
        ({"attention_head_dim": 4}, "cannot be split into 3D RoPE axes"),
        ({"patch_size": (1, 2)}, "patch_size must be 3 positive ints"),
        ({"image_dim": 24, "added_kv_proj_dim": 16}, "added_kv_proj_dim must equal heads \\* head_dim = 32"),
        ({"added_kv_proj_dim": 32}, "added_kv_proj_dim needs image_dim"),
        ({"qk_norm": "layer_norm"}, "qk_norm must be one of"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WanDiTConfig(**tiny_wan_dit_config(**overrides))


def test_config_out_channels_none_means_in_channels() -> None:
    assert WanDiTConfig(**tiny_wan_dit_config(in_channels=36, out_channels=None)).out_channels == 36


@torch.no_grad()
def test_forward_rejects_bad_shapes() -> None:
    model = WanDiT(WanDiTConfig(**tiny_wan_dit_config()))
    inputs = _inputs(CASES[0])
    with pytest.raises(ValueError, match="timestep must be"):
        model(**{**inputs, "timestep": torch.zeros(1, 4)})  # neither per frame (3) nor per token (45)
    with pytest.raises(ValueError, match="divisible by patch_size"):
        model(**{**inputs, "hidden_states": torch.zeros(1, 16, 3, 5, 10)})
    with pytest.raises(ValueError, match="encoder_hidden_states_image=None"):
        model(**inputs, encoder_hidden_states_image=torch.zeros(1, 4, 24))


def test_rope_tables_survive_module_casts_and_to_empty() -> None:
    config = WanDiTConfig(**tiny_wan_dit_config())
    model = WanDiT(config)
    table = model.rope.cos_table.clone()
    model.to(torch.bfloat16)
    assert model.rope.cos_table.dtype == torch.float32 and torch.equal(model.rope.cos_table, table)
    assert model.proj_out.weight.dtype == torch.bfloat16
    with torch.device("meta"):
        materialized = WanDiT(config)
    materialized.to_empty(device="cpu")
    assert torch.equal(materialized.rope.cos_table, table)


def test_src_does_not_import_diffusers() -> None:
    import omniloop.models.families.wan.model as model_module
    import omniloop.models.families.wan.weights as weights_module

    for module in (model_module, weights_module):
        source = Path(module.__file__).read_text()
        assert not re.search(r"^\s*(from|import)\s+diffusers", source, re.MULTILINE), module.__name__
