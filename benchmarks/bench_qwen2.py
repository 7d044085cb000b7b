"""Qwen2 at a published architecture with random weights: the checkpoint folder a user holds
(transformers' ``save_pretrained`` layout), served by our engine vs transformers' ``generate``
on the same weights, side by side in one run.

Measured: time to first token (prompt of ``--prompt-tokens``), decode tokens/s of one request,
and aggregate decode tokens/s of ``--batch`` concurrent requests (steps batched across them by
the engine's paged decode); transformers' ``generate`` at batch 1 and at the same batch (padded
prompts of equal length, so no padding). Random weights emit no EOS in practice; every request
runs its ``max_tokens`` (EOS ids are cleared so a chance EOS cannot end one early).

    python benchmarks/bench_qwen2.py --arch 7b --out qwen2_h200.jsonl   # GPU
    python benchmarks/bench_qwen2.py --tiny                              # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import emit  # benchmarks/ is on sys.path when this runs as a script
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.models.families.qwen2.presets import QWEN25_0_5B, QWEN25_7B
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart

ARCHS = {"0.5b": QWEN25_0_5B, "7b": QWEN25_7B,
         "tiny": {**QWEN25_0_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}


def byte_tokenizer(folder: Path, vocab_size: int):
    """Qwen2's scheme (byte-level BPE, which transformers rebuilds for a ``qwen2`` config) with no
    merges: one token per byte of a prompt, and filler tokens up to the model's vocabulary so
    every id a random model emits decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"w{i}": i for i in range(len(alphabet), vocab_size - 1)})
    vocab["<|endoftext|>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def save_random_qwen2(folder: Path, arch: dict, device: torch.device, dtype: torch.dtype) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    byte_tokenizer(folder, arch["vocab_size"])
    config = Qwen2Config(**{**arch, "eos_token_id": arch["vocab_size"] - 1, "bos_token_id": None, "pad_token_id": arch["vocab_size"] - 1})
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)


def prompt(tokens: int, offset: int) -> str:
    """``tokens`` letters (one token each: the tokenizer has no merges), different per request."""
    return "".join(chr(ord("a") + (offset * 7919 + i * 31) % 26) for i in range(tokens))


def request(rid: str, args, offset: int) -> OmniRequest:
    return OmniRequest(task=TaskType.REASON, request_id=rid, inputs=[TextPart(text=prompt(args.prompt_tokens, offset))],
                       sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0))


def no_eos(pipeline: Pipeline) -> Pipeline:
    text = dataclasses.replace(pipeline.defaults.text_or_default(), eos_token_ids=())
    return dataclasses.replace(pipeline, defaults=pipeline.defaults.replace(text=text))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(pipeline: Pipeline, args, batch: int) -> dict:
    """``batch`` requests added together; -> TTFT (first request's first token), decode tok/s."""
    engine = Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(max_batch=batch, max_running=batch)))
    ids = [f"r{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for i, rid in enumerate(ids):
        engine.add_request(request(rid, args, i))
    first = None
    while engine.has_unfinished():
        outs = engine.step()
        sync(pipeline.device)
        if first is None and any(engine._requests[r].loop is not None and engine._requests[r].loop.output_ids
                                 for r in ids if r in engine._requests):
            first = time.perf_counter() - t0
        for out in outs:
            assert out.error is None, out.error
            assert len(out.text.token_ids) == args.max_tokens, len(out.text.token_ids)
    total = time.perf_counter() - t0
    first = first if first is not None else total
    return {"ttft_s": round(first, 4), "total_s": round(total, 4),
            "decode_tok_per_s": round(batch * (args.max_tokens - 1) / max(total - first, 1e-9), 1)}


def run_transformers(model, tokenizer, args, batch: int, device: torch.device) -> dict:
    ids = torch.stack([tokenizer(prompt(args.prompt_tokens, i), return_tensors="pt").input_ids[0] for i in range(batch)])
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, **kw)
    sync(device)
    total = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == args.max_tokens
    return {"ttft_s": round(ttft, 4), "total_s": round(total, 4),
            "decode_tok_per_s": round(batch * (args.max_tokens - 1) / max(total - ttft, 1e-9), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", default="7b", choices=sorted(ARCHS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke: --arch tiny, small prompts")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--iters", type=int, default=2, help="runs per case (the best is reported: warm)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--cuda-graphs", default="off", choices=("off", "on", "both"),
                   help="ours with the decode replayed from CUDA graphs (cuda_graphs=True): on, or both (eager, then graphs)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.arch, args.prompt_tokens, args.max_tokens, args.batches = "tiny", 16, 8, "1,4"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = ARCHS[args.arch]
    folder = Path(tempfile.mkdtemp(prefix="qwen2_bench_"))
    t0 = time.perf_counter()
    save_random_qwen2(folder, arch, device, dtype)
    saved_s = time.perf_counter() - t0
    sink = open(args.out, "a") if args.out else None
    base = {"bench": "qwen2", "arch": args.arch, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        graph_modes = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
        if device.type != "cuda" and any(graph_modes):
            p.error("--cuda-graphs on/both needs a CUDA device (leave it off for --tiny / the CPU)")
        batches = [int(b) for b in args.batches.split(",")]
        for graphs in graph_modes:
            t0 = time.perf_counter()
            options = LoadOptions(device=device, dtype=dtype, kv_cache_gb=args.kv_cache_gb, cuda_graphs=graphs)
            _, pipeline = load_pipeline(folder, options)
            sync(device)
            emit({**base, "metric": "load_s", "cuda_graphs": graphs, "value": round(time.perf_counter() - t0, 2),
                  "save_s": round(saved_s, 1)}, sink)
            pipeline = no_eos(pipeline)
            with torch.inference_mode():
                run_engine(pipeline, args, 1)  # warm (allocator, kernels; with graphs: batch 1's capture)
                for batch in batches:
                    runs = [run_engine(pipeline, args, batch) for _ in range(args.iters)]
                    best = max(runs, key=lambda r: r["decode_tok_per_s"])
                    graph_stats = pipeline.caches["cuda_graphs"].summary() if graphs else None
                    emit({**base, "metric": "ours", "batch": batch, "cuda_graphs": graphs, **best,
                          "ttft_median_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
                          "graphs": graph_stats}, sink)
            del pipeline
        if args.transformers:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            from transformers import AutoTokenizer, Qwen2ForCausalLM

            model = Qwen2ForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
            tokenizer = AutoTokenizer.from_pretrained(folder)
            with torch.inference_mode():
                run_transformers(model, tokenizer, args, 1, device)  # warm
                for batch in batches:
                    runs = [run_transformers(model, tokenizer, args, batch, device) for _ in range(args.iters)]
                    best = max(runs, key=lambda r: r["decode_tok_per_s"])
                    emit({**base, "metric": "transformers_generate", "batch": batch, **best}, sink)
    finally:
        if sink:
            sink.close()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)  # a 7B checkpoint is 15 GB of the device's disk
    return 0


if __name__ == "__main__":
    sys.exit(main())
