"""FLUX.2 [klein] KV reference cache: the forwards of one edit with and without it (JSON lines).

One edit's ``--steps`` denoise forwards of the klein DiT (random weights, the same tensors in
all three) at 1024x1024 (4096 image tokens + 512 text tokens) with ``--refs`` 1024x1024
reference images (4096 tokens each), three ways:

- ``uncached``: every step carries the reference tokens (Flux2KleinPipeline's edit);
- ``cached``: ours, the references' keys/values computed once (``Flux2Transformer.reference_kv``)
  and every step running the image tokens alone against them;
- ``diffusers_kv``: diffusers' Flux2KleinKVPipeline transformer calls (``extract`` on the first
  step, ``cached`` after).

Per way: the median seconds of the whole edit's forwards over ``--iters`` runs after
``--warmup``, the token rows its forwards carried through the DiT (``dit_rows``: the work the
cache saves), and for ``cached`` the max |diff| of every step's prediction against
``diffusers_kv`` (fp32 on the CPU: 0). The GPU run uses the klein-4B architecture (5 double +
20 single blocks; FLUX.2-klein-9b-kv's 9B has the same block kinds, wider and deeper).
``--tiny``: toy sizes on the CPU (CPU times give ratios, not the GPU's).

    python benchmarks/bench_flux2_kv.py --out $OUT/flux2_kv_h100.jsonl   # GPU (H100 / H200: name it)
    python benchmarks/bench_flux2_kv.py --tiny                          # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import built_in, emit, jsonl_sink, timed  # noqa: E402
from omniloop.models.families.flux2.model import Flux2Config, Flux2Inputs, Flux2Transformer  # noqa: E402
from omniloop.models.families.flux2.presets import KLEIN_4B  # noqa: E402
from omniloop.models.families.flux2.stages import grid_ids, reference_ids, text_ids  # noqa: E402

TINY = {**KLEIN_4B, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 48, "axes_dims_rope": (4, 4, 4, 4), "in_channels": 16,
        "timestep_guidance_channels": 32}


def build(config: dict, device: torch.device, dtype: torch.dtype):
    """diffusers' DiT with its KV attention processors and ours, the same random weights."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor,
                                                                 Flux2KVParallelSelfAttnProcessor)

    reference = built_in(device, dtype, lambda: Flux2Transformer2DModel(**config))
    for block in reference.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in reference.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    ours = built_in(device, dtype, lambda: Flux2Transformer(Flux2Config(**config)))
    ours.load_state_dict(reference.state_dict())
    return reference, ours


class Edit:
    """One edit's inputs: the noisy tokens, the text, the references and the step times."""

    def __init__(self, config: dict, args, device: torch.device, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        grid, refs = args.grid, args.refs
        self.image = torch.randn(1, grid * grid, config["in_channels"], generator=g).to(device, dtype)
        self.refs = torch.randn(1, refs * grid * grid, config["in_channels"], generator=g).to(device, dtype)
        self.text = torch.randn(1, args.text_tokens, config["joint_attention_dim"], generator=g).to(device, dtype)
        self.ids = grid_ids(grid, grid, 0, device)
        self.ref_ids = reference_ids(((grid, grid),) * refs, device)
        self.text_ids = text_ids(args.text_tokens, device)
        self.times = [torch.full((1,), float(s), device=device, dtype=dtype)
                      for s in np.linspace(1.0, 1 / args.steps, args.steps)]


def uncached(model: Flux2Transformer, e: Edit) -> list[torch.Tensor]:
    image, ids = torch.cat([e.image, e.refs], dim=1), torch.cat([e.ids, e.ref_ids])
    return [model(Flux2Inputs(image=image, text=e.text, timestep=t, image_ids=ids, text_ids=e.text_ids))[:, :e.image.shape[1]]
            for t in e.times]


def cached(model: Flux2Transformer, e: Edit) -> list[torch.Tensor]:
    kv = model.reference_kv(e.refs, e.ref_ids)
    return [model(Flux2Inputs(image=e.image, text=e.text, timestep=t, image_ids=e.ids, text_ids=e.text_ids,
                              reference_kv=kv)) for t in e.times]


def diffusers_kv(model, e: Edit) -> list[torch.Tensor]:
    out, cache = model(hidden_states=torch.cat([e.refs, e.image], dim=1), encoder_hidden_states=e.text,
                       timestep=e.times[0], img_ids=torch.cat([e.ref_ids, e.ids])[None], txt_ids=e.text_ids[None],
                       guidance=None, return_dict=False, kv_cache_mode="extract", num_ref_tokens=e.refs.shape[1])
    outs = [out]
    for t in e.times[1:]:
        outs.append(model(hidden_states=e.image, encoder_hidden_states=e.text, timestep=t, img_ids=e.ids[None],
                          txt_ids=e.text_ids[None], guidance=None, return_dict=False, kv_cache=cache,
                          kv_cache_mode="cached")[0])
    return outs


def dit_rows(way: str, e: Edit, steps: int) -> int:
    """Token rows (image + reference; the text's are the same in every way) the edit's forwards carry."""
    img, ref = e.image.shape[1], e.refs.shape[1]
    return steps * (img + ref) if way == "uncached" else ref + steps * img


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--steps", type=int, default=4, help="denoise steps (klein KV: 4)")
    p.add_argument("--refs", type=int, default=2, help="reference images, each the output's size")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = TINY if args.tiny else KLEIN_4B
    args.grid, args.text_tokens = (16, 16) if args.tiny else (64, 512)  # 1024 px / 16 -> 64 x 64 tokens
    args.iters = args.iters or (3 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    reference, ours = build(config, device, dtype)
    e, cuda = Edit(config, args, device, dtype), device.type == "cuda"
    ways = {"uncached": lambda: uncached(ours, e), "cached": lambda: cached(ours, e),
            "diffusers_kv": lambda: diffusers_kv(reference, e)}
    with torch.inference_mode():
        want = diffusers_kv(reference, e)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(cached(ours, e), want))
        seconds = {w: statistics.median(timed(fn, warmup=args.warmup, iters=args.iters, cuda=cuda))
                   for w, fn in ways.items()}
    with jsonl_sink(args.out) as sink:
        for way in ways:
            emit({"bench": "flux2_kv_edit", "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "dtype": str(dtype).removeprefix("torch."), "way": way, "steps": args.steps,
                  "references": args.refs, "image_tokens": e.image.shape[1], "reference_tokens": e.refs.shape[1],
                  "text_tokens": args.text_tokens, "dit_rows": dit_rows(way, e, args.steps),
                  "seconds": round(seconds[way], 5), "vs_uncached": round(seconds["uncached"] / seconds[way], 3),
                  **({"max_abs_diff_vs_diffusers_kv": diff} if way == "cached" else {})}, sink)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
