"""One batched AR decode step (``ARDecodeLoop.step_many``) of the Qwen2 LM, the Qwen2.5-Omni
thinker and its talker, and Qwen3-Omni's MoE thinker (``thinker3``) at batch 1, 8 and 32, rows at different context lengths: where a step's
time goes, split into the model's forward and the host work around it (building the inputs,
the paged-KV indices, sampling, stop checks, the stream chunks).

A decode step of a memory-bound model should cost about the same at batch 32 as at batch 1 (the
weights are read once), so host work that grows with the batch is the thing to find. Per step:

* ``step_ms``: the whole ``step_many`` (synchronized on a GPU);
* ``forward_ms``: the model's ``forward`` (hooks around it, synchronized on a GPU), and
  ``host_ms = step_ms - forward_ms`` (``host_ms_per_row``: divided by the batch);
* ``ops_outside_forward`` / ``ops_in_forward``: aten ops dispatched (each a kernel launch on a
  GPU), counted in one extra step under a dispatch mode, and ``host_syncs``: device-to-host
  reads (``.item()``, ``int(t)``, ``.tolist()``): on a GPU each waits for the queue to drain.

The models are our classes built with random weights in place (no checkpoint: the step's
cost does not depend on the values); the step is the stage's own (``ARDecodeLoop``,
``ThinkerLoop``, ``TalkerLoop``), its loops made as ``init`` makes them (prefill included).

``--cuda-graphs both`` (a GPU) measures every case eager and then with the decode forward replayed
from CUDA graphs (``pipeline/loops/ar_graphs.py``, the stage's ``graphs``: what ``cuda_graphs=True``
deploys), ``cuda_graphs`` on each line. A replayed step runs no forward hook, so with graphs
``forward_ms`` / ``host_ms`` are not split out (null): compare ``step_ms``; ``graph_captures`` /
``graph_replays`` / ``capture_failures`` count the runner's work in the case (warmup included).

    python benchmarks/bench_ar_step.py --out benchmarks/results/ar_step_cpu.jsonl    # CPU, tiny dims
    python benchmarks/bench_ar_step.py --arch 7b --out $OUT/ar_step_h100.jsonl       # GPU, published 7B dims, bf16
    python benchmarks/bench_ar_step.py --arch 7b --cuda-graphs both --out $OUT/ar_step_graphs_h100.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (common)
from common import built_in, emit, fill_unset, jsonl_sink, profile_top  # noqa: E402

from omniloop.cache.paged_kv import BlockPool  # noqa: E402
from omniloop.models.families.qwen2.model import Qwen2Config, Qwen2LM  # noqa: E402
from omniloop.models.families.qwen2.presets import QWEN25_7B  # noqa: E402
from omniloop.models.families.qwen2_5_omni.model import (  # noqa: E402
    DecoderConfig, OmniTalker, OmniThinker, TalkerRow, TalkerTokens, ThinkerRow,
)
from omniloop.models.families.qwen2_5_omni.stages import TalkerLoop, TalkerLoopState, ThinkerLoop  # noqa: E402
from omniloop.models.families.qwen3_omni.model import Qwen3DecoderConfig, Qwen3OmniThinker  # noqa: E402
from omniloop.models.layers.cuda_graphs import CudaGraphRunner  # noqa: E402
from omniloop.models.omni.talker import CodecVocab  # noqa: E402
from omniloop.pipeline.loops.ar import ARDecodeLoop, ARLoopState  # noqa: E402
from omniloop.pipeline.state import StageContext  # noqa: E402
from omniloop.pipeline.streams import EdgeChannel  # noqa: E402
from omniloop.request import SamplingParams  # noqa: E402

MODELS = ("qwen2", "thinker", "talker", "thinker3")  # thinker3: Qwen3-Omni's MoE thinker
# Each model's sampling variants: the thinker as bench_omni runs it (greedy); the talker greedy
# with its repetition penalty (a request's temperature 0) and with transformers' talker defaults.
VARIANTS = {"qwen2": ("greedy", "mixed", "logprobs"), "thinker": ("greedy",), "talker": ("greedy_rep", "sampled"),
            "thinker3": ("greedy",)}
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)  # the talker's defaults
MROPE = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 24]}}
ARCHS: dict[str, dict[str, dict[str, Any]]] = {
    # CPU: dims small enough that the host work, not the matmuls, is what a step measures
    "tiny": {
        "qwen2": {**QWEN25_7B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "thinker": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        "talker": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                       rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        "thinker3": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]}),
    },
    # the published Qwen2.5-7B / Qwen2.5-Omni-7B (benchmarks/bench_omni.py PUBLISHED_7B)
    "7b": {
        "qwen2": QWEN25_7B,
        "thinker": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, **MROPE),
        "talker": dict(vocab_size=8448, hidden_size=896, intermediate_size=18944, num_hidden_layers=24,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=128, **MROPE),
        # Qwen3-Omni-30B-A3B's thinker with 12 of its 48 layers (each 1.2 GB of experts in bf16: the
        # whole one is ~60 GB); a step's cost is per layer, so x4 for the released model
        "thinker3": dict(vocab_size=152064, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]}),
    },
}
TALKER_TOKENS = dict(codec_bos=8293, codec_eos=8294, codec_pad=8292, codec_mask=8296, text_bos=151872,
                     text_eos=151873, text_pad=151859)


class LetterTokenizer:
    """Decodes each id to one letter (the loop detokenizes every step: a real, cheap decode)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@dataclass
class Bench:
    """One model's stage, context and a loop factory."""

    stage: ARDecodeLoop
    ctx: StageContext
    lm: torch.nn.Module
    make_loop: Callable[[int, int, SamplingParams, int | None], ARLoopState]


def _pool(lm: Any, device: torch.device, dtype: torch.dtype, tokens: int) -> BlockPool:
    return BlockPool(lm.kv_layout, dtype=dtype, device=device, budget_bytes=tokens * lm.kv_layout.bytes_per_token(dtype),
                     block_size=16)


def build(model: str, arch: str, device: torch.device, dtype: torch.dtype, kv_tokens: int) -> Bench:
    cfg = ARCHS[arch][model]
    if model == "qwen2":
        lm: Any = built_in(device, dtype, lambda: Qwen2LM(Qwen2Config.from_hf_config(cfg)))
        stage, tokenizer = ARDecodeLoop(), LetterTokenizer()
    elif model == "thinker":
        lm = built_in(device, dtype, lambda: OmniThinker(DecoderConfig.from_hf(cfg)))
        stage, tokenizer = ThinkerLoop(), LetterTokenizer()
    elif model == "thinker3":
        lm = built_in(device, dtype, lambda: Qwen3OmniThinker(Qwen3DecoderConfig.from_hf(cfg, part="thinker")))
        stage, tokenizer = ThinkerLoop(), LetterTokenizer()
    else:
        emb = ARCHS[arch]["thinker"]["hidden_size"]
        tokens = TalkerTokens(**{k: min(v, cfg["vocab_size"] - 1 - i) for i, (k, v) in enumerate(TALKER_TOKENS.items())})
        lm = built_in(device, dtype, lambda: OmniTalker(DecoderConfig.from_hf(cfg, embedding_size=emb), tokens))
        stage, tokenizer = TalkerLoop(), CodecVocab()
    pool = _pool(lm, device, dtype, kv_tokens)
    ctx = StageContext(node=model, components={"lm": lm, "tokenizer": tokenizer, "text_kv": pool}, device=device,
                       dtype=dtype)
    gen = torch.Generator(device).manual_seed(0)

    def make_loop(row: int, prompt_len: int, params: SamplingParams, top_logprobs: int | None) -> ARLoopState:
        vocab = cfg["vocab_size"]
        ids = torch.randint(0, min(vocab, 8000), (prompt_len,), generator=torch.Generator().manual_seed(row)).tolist()
        common = dict(node=model, request_id=f"r{row}", steps_target=params.max_tokens, params=params, seed=row,
                      generator=torch.Generator(device).manual_seed(row), kv=pool.handle(), prefill_chunk=512,
                      prompt_ids=ids, stop_ids=frozenset(), top_logprobs=top_logprobs)
        if model == "talker":
            talker_row = TalkerRow(prompt_embeds=torch.randn(prompt_len, emb, generator=gen, device=device, dtype=dtype),
                                   reply=torch.randn(prompt_len // 2 + 1, emb, generator=gen, device=device, dtype=dtype))
            loop: ARLoopState = TalkerLoopState(**common, lm_inputs=talker_row,
                                                feed=EdgeChannel("thinker_hidden", closed=True))
        else:
            loop = ARLoopState(**common, lm_inputs=ThinkerRow(record_states=True) if model.startswith("thinker") else None)
        stage._prefill(lm, [loop])  # as init does
        loop.steps_target += loop.chunks_left()
        while loop.prefilling:  # a prompt over prefill_chunk: its other chunks (the engine's batch_key never
            stage.step_many(ctx, [loop])  # steps a prefilling row with decoding ones, so neither may this)
        return loop

    return Bench(stage, ctx, lm, make_loop)


def row_params(variant: str, row: int, max_tokens: int) -> tuple[SamplingParams, int | None]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if variant == "greedy":
        return greedy, None
    if variant == "logprobs":
        return greedy, 5
    if variant == "greedy_rep":
        return SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=max_tokens), None
    sampled = SamplingParams(**SAMPLED, max_tokens=max_tokens, seed=row)
    if variant == "sampled":
        return sampled, None
    assert variant == "mixed", variant
    return (greedy if row % 2 == 0 else sampled), None


# -- measuring ----------------------------------------------------------------------------------


class ForwardClock:
    """Seconds inside the model's forward (hooks; synchronized on a GPU) and whether a forward runs."""

    def __init__(self, lm: torch.nn.Module, device: torch.device) -> None:
        self.device, self.seconds, self.inside, self._t0 = device, 0.0, False, 0.0
        self._handles = [lm.register_forward_pre_hook(self._pre), lm.register_forward_hook(self._post)]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pre(self, *_: Any) -> None:
        self._sync()
        self.inside, self._t0 = True, time.perf_counter()

    def _post(self, *_: Any) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.inside = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class OpCounter(TorchDispatchMode):
    """aten ops dispatched inside / outside the forward, and device-to-host reads."""

    SCALAR_READS = {"aten.item.default", "aten._local_scalar_dense.default"}

    def __init__(self, clock: ForwardClock) -> None:
        super().__init__()
        self.clock, self.inside, self.outside, self.syncs = clock, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.clock.inside:
            self.inside += 1
        else:
            self.outside += 1
        if str(func) in self.SCALAR_READS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def count_tolist(counter: OpCounter) -> Callable[[], None]:
    """``Tensor.tolist`` reads the device too (a CPU tensor's dispatches nothing): counted as a sync.
    -> the undo."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor):
        counter.syncs += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return lambda: setattr(torch.Tensor, "tolist", original)


def graph_counts(runner: CudaGraphRunner | None) -> dict[str, int]:
    """The runner's counts so far (none without graphs)."""
    if runner is None:
        return {}
    s = runner.summary()
    return {"graph_captures": s["captures"], "graph_replays": s["replays"], "capture_failures": s["capture_failures"]}


def measure(bench: Bench, loops: list[ARLoopState], iters: int, warmup: int) -> dict:
    clock = ForwardClock(bench.lm, bench.ctx.device)
    sync = clock._sync
    steps, forwards = [], []
    try:
        for i in range(warmup + iters):
            clock.seconds = 0.0
            sync()
            t0 = time.perf_counter()
            results = bench.stage.step_many(bench.ctx, loops)
            sync()
            total = time.perf_counter() - t0
            assert all(r.error is None for r in results), [r.error for r in results]
            if i >= warmup:
                steps.append(total)
                forwards.append(clock.seconds)
        counter = OpCounter(clock)
        undo = count_tolist(counter)
        try:
            with counter:
                bench.stage.step_many(bench.ctx, loops)
        finally:
            undo()
    finally:
        clock.remove()
    step, fwd = statistics.median(steps), statistics.median(forwards)
    hosts = sorted(s - f for s, f in zip(steps, forwards))
    host = statistics.median(hosts)
    b = len(loops)
    return {"step_ms": round(step * 1e3, 3), "forward_ms": round(fwd * 1e3, 3), "host_ms": round(host * 1e3, 3),
            "host_ms_per_row": round(host * 1e3 / b, 4), "ops_outside_forward": counter.outside,
            "ops_in_forward": counter.inside, "host_syncs": counter.syncs}


PROFILED_STEPS = 3


def run_case(bench: Bench, model: str, variant: str, batch: int, contexts: list[int], args) -> tuple[dict, list[dict]]:
    """-> the case's record, and (``--profile``) its top kernels / ops per step."""
    max_tokens = args.warmup + args.iters + PROFILED_STEPS + 6  # no row ends while measured
    before = graph_counts(bench.stage.graphs)
    loops = []
    for row in range(batch):
        params, top = row_params(variant, row, max_tokens)
        loops.append(bench.make_loop(row, contexts[row % len(contexts)], params, top))
    kernels: list[dict] = []
    with torch.inference_mode():
        rec = measure(bench, loops, args.iters, args.warmup)
        if args.profile:
            kernels = profile_top(lambda: bench.stage.step_many(bench.ctx, loops), cuda=bench.ctx.device.type == "cuda",
                                  steps=PROFILED_STEPS, top=12)
    for lp in loops:
        bench.stage.release(lp)
    case = {"model": model, "sampling": variant, "batch": batch,
            "contexts": sorted({contexts[r % len(contexts)] for r in range(batch)}),
            "cuda_graphs": bench.stage.graphs is not None}
    if bench.stage.graphs is not None:  # the replay runs no forward hook: no forward / host split
        rec.update(forward_ms=None, host_ms=None, host_ms_per_row=None,
                   **{k: v - before[k] for k, v in graph_counts(bench.stage.graphs).items()})
    busy = next((k["ms_per_call"] / k["share"] for k in kernels if k["share"] > 0), None)
    if busy is not None:  # what the device (CPU: the ops) was busy with per step, of step_ms
        rec["busy_ms"] = round(busy, 3)
    return {**case, **rec}, [{**case, "metric": "profile", **k} for k in kernels]


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default="tiny")
    p.add_argument("--models", default=",".join(MODELS), help="comma separated: " + ", ".join(MODELS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default=None,
                   help="prompt lengths, row i takes the (i mod n)-th (default tiny: 24,77,130,301; 7b: 64,130,257,700)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per case (median reported; tiny 30, 7b 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    p.add_argument("--device", default=None, help="cpu (tiny) / cuda (7b)")
    p.add_argument("--profile", action="store_true",
                   help="also the top kernels (GPU) / ops (CPU) of each case's step, and busy_ms: the device's "
                        "time per step (step_ms - busy_ms: the device waiting for the host)")
    p.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="off",
                   help="decode forwards replayed from CUDA graphs (a GPU): on, or both (each case eager, then on)")
    p.add_argument("--label", default=None, help="a label field on every line (e.g. before / after)")
    p.add_argument("--machine", default=None, help="the machine, in words (default: the device's name)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tiny = args.arch == "tiny"
    fill_unset(args, {"contexts": "24,77,130,301" if tiny else "64,130,257,700", "iters": 30 if tiny else 20,
                      "device": "cpu" if tiny else "cuda"})
    if args.cuda_graphs != "off" and not args.device.startswith("cuda"):
        p.error(f"--cuda-graphs {args.cuda_graphs} replays CUDA graphs: pass --device cuda (or --cuda-graphs off)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_tokens = max(batches) * (max(contexts) + args.warmup + 2 * args.iters + 64) + 64
    machine = args.machine or (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    base = {"bench": "ar_step", "arch": args.arch, "device": machine, "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "threads": args.threads, **({"label": args.label} if args.label else {})}
    with jsonl_sink(args.out) as sink:
        for model in args.models.split(","):
            bench = build(model, args.arch, device, dtype, kv_tokens)
            runners = {"off": [None], "on": [CudaGraphRunner()], "both": [None, CudaGraphRunner()]}[args.cuda_graphs]
            for variant in VARIANTS[model]:
                for batch in batches:
                    for runner in runners:  # the same model and loops' shapes, eager then replayed
                        bench.stage.graphs = runner
                        rec, kernels = run_case(bench, model, variant, batch, contexts, args)
                        emit({**base, **rec}, sink)
                        for k in kernels:
                            emit({**base, **k}, sink)
            del bench
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
