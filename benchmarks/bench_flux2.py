"""FLUX.2 [klein] transformer forward, ours vs diffusers, side by side (JSON lines).

One denoise forward of the klein-4B DiT (5 double + 20 single blocks, 3072 wide; random bf16
weights, the same tensors in both) at 1024x1024 (4096 image tokens + 512 text tokens), with
and without one 1024x1024 reference image (+4096 tokens), batch 1 and 2 (CFG's two branches
as one batch): median seconds of ``--iters`` calls after ``--warmup``, both eager, and the
two outputs' max |diff| (bf16: not bit-equal, the same math). ``--tiny``: the toy sizes on the
CPU (a smoke run; CPU times are not the GPU's).

    python benchmarks/bench_flux2.py --out $OUT/flux2_h100.jsonl      # GPU (H100 / H200: name it)
    python benchmarks/bench_flux2.py --tiny                           # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import built_in, emit, jsonl_sink, timed  # noqa: E402
from omniloop.models.families.flux2.model import Flux2Config, Flux2Inputs, Flux2Transformer  # noqa: E402
from omniloop.models.families.flux2.presets import KLEIN_4B  # noqa: E402
from omniloop.models.families.flux2.stages import grid_ids, reference_ids, text_ids  # noqa: E402

TINY = {**KLEIN_4B, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 48, "axes_dims_rope": (4, 4, 4, 4), "in_channels": 16,
        "timestep_guidance_channels": 32}


def build(config: dict, device: torch.device, dtype: torch.dtype):
    """Both DiTs with the same random weights (diffusers' init, copied into ours)."""
    from diffusers import Flux2Transformer2DModel

    reference = built_in(device, dtype, lambda: Flux2Transformer2DModel(**config))
    ours = built_in(device, dtype, lambda: Flux2Transformer(Flux2Config(**config)))
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def case_inputs(config: dict, grid: int, text: int, batch: int, refs: int, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = grid * grid * (1 + refs)
    image = torch.randn(batch, tokens, config["in_channels"], generator=g).to(device, dtype)
    txt = torch.randn(batch, text, config["joint_attention_dim"], generator=g).to(device, dtype)
    t = torch.full((batch,), 0.7, device=device, dtype=dtype)
    ids = grid_ids(grid, grid, 0, device)
    if refs:
        ids = torch.cat([ids, reference_ids(((grid, grid),) * refs, device)])
    return image, txt, t, ids, text_ids(text, device)


def run_case(reference, ours, config, args, device, dtype, *, batch: int, refs: int, sink) -> None:
    image, txt, t, img_ids, txt_ids = case_inputs(config, args.grid, args.text_tokens, batch, refs, device, dtype)
    cuda = device.type == "cuda"

    def theirs():
        return reference(hidden_states=image, encoder_hidden_states=txt, timestep=t, img_ids=img_ids[None],
                         txt_ids=txt_ids[None], guidance=None, return_dict=False)[0]

    def mine():
        return ours(Flux2Inputs(image=image, text=txt, timestep=t, image_ids=img_ids, text_ids=txt_ids))

    with torch.inference_mode():
        diff = (theirs().float() - mine().float()).abs().max().item()
        t_ref = statistics.median(timed(theirs, warmup=args.warmup, iters=args.iters, cuda=cuda))
        t_ours = statistics.median(timed(mine, warmup=args.warmup, iters=args.iters, cuda=cuda))
    emit({"bench": "flux2_forward", "device": torch.cuda.get_device_name() if cuda else "cpu",
          "dtype": str(dtype).removeprefix("torch."), "batch": batch, "references": refs,
          "image_tokens": image.shape[1], "text_tokens": txt.shape[1], "diffusers_s": round(t_ref, 5),
          "ours_s": round(t_ours, 5), "ours_vs_diffusers": round(t_ref / t_ours, 3), "max_abs_diff": diff}, sink)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (smoke run)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = TINY if args.tiny else KLEIN_4B
    args.grid, args.text_tokens = (4, 16) if args.tiny else (64, 512)  # 1024 px / 16 -> 64 x 64 tokens
    args.iters = args.iters or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    reference, ours = build(config, device, dtype)
    with jsonl_sink(args.out) as sink:
        for batch, refs in ((1, 0), (2, 0), (1, 1)):
            run_case(reference, ours, config, args, device, dtype, batch=batch, refs=refs, sink=sink)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
