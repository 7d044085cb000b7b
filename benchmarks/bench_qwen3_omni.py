"""Qwen3-Omni (issue 32's optional family): a spoken answer (MoE thinker -> MoE talker + code
predictor -> code2wav) through our engine vs transformers' ``Qwen3OmniMoeForConditionalGeneration.
generate`` on the same weights, side by side in one run.

* ``single``: one spoken answer at batch 1: time to the first audio chunk and the real-time
  factor (seconds of compute per second of audio): ours streamed (``outputs.stream``: the talker
  starts at the thinker's first token, code2wav decodes 25-frame windows as the frames come), ours
  non-streamed (transformers' chunked decode of all the frames), transformers' ``generate``
  (non-streamed: its first audio is its whole audio).
* ``concurrent``: N streamed answers added together (thinker, talker and code-predictor steps
  batched across requests) vs the same answers one at a time.

Greedy on both sides (every AR stage: thinker, talker, code predictor), so both make the same
answer (the family's parity tests: tests/models/qwen3_omni/); lengths are the model's own (its
EOS and codec end), reported per record. Weights: ``--tiny`` (CPU smoke: the tests' tiny
checkpoint, built here) or ``--checkpoint DIR`` (a Qwen3-Omni folder on the machine, e.g. the
released Qwen3-Omni-30B-A3B-Instruct; nothing is downloaded).

    python benchmarks/bench_qwen3_omni.py --tiny
    python benchmarks/bench_qwen3_omni.py --checkpoint /ckpt/Qwen3-Omni-30B-A3B-Instruct --out $OUT/q3.jsonl
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (common, bench_omni, bench_qwen2)
from bench_omni import Served, audio_seconds, ours_records, serve, steps_by_node  # noqa: E402
from bench_qwen2 import sync  # noqa: E402
from common import emit  # noqa: E402

from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.pipeline.pipeline import Pipeline  # noqa: E402
from omniloop.request import Modality, OmniOutput, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart  # noqa: E402

SAMPLE_RATE = 24000
QUESTIONS = ["say hello to the user", "the quick brown fox", "one two three four five six", "hello world"]


def question(i: int) -> str:
    return QUESTIONS[i % len(QUESTIONS)]


def spoken_request(rid: str, args, i: int, *, stream: bool) -> OmniRequest:
    return OmniRequest(task=TaskType.REASON, request_id=rid, inputs=[TextPart(text=question(i), role="user")],
                       sampling=SamplingParams(max_tokens=args.text_tokens, temperature=0.0, seed=i),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO], stream=stream),
                       node_params={"talker": {"max_tokens": args.audio_frames}})


def check_answer(out: OmniOutput, args) -> None:
    assert out.error is None, out.error
    assert out.text is not None and out.audio is not None and out.audio.samples.numel() > 0, out


def run_transformers(hf, tokenizer, args, device: torch.device) -> dict:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question(0)}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"].to(device)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sync(device)
    t0 = time.perf_counter()
    seq, wav = hf.generate(ids, speaker="Ethan", thinker_do_sample=False, thinker_max_new_tokens=args.text_tokens,
                           thinker_eos_token_id=eos, talker_do_sample=False, talker_max_new_tokens=args.audio_frames)
    sync(device)
    total = time.perf_counter() - t0
    audio_s = wav.numel() / SAMPLE_RATE
    return {"first_audio_s": round(total, 4), "total_s": round(total, 4), "audio_s": round(audio_s, 3),
            "rtf": round(total / max(audio_s, 1e-9), 4), "text_tokens": seq.shape[1] - ids.shape[1]}


def run_single(pipeline: Pipeline, args, *, stream: bool) -> dict:
    served = serve(pipeline, [spoken_request("solo", args, 0, stream=stream)], args, check=check_answer)
    out, audio_s = served.outputs["solo"], audio_seconds(served)
    return {"first_audio_s": round(served.first_audio_s["solo"], 4), "total_s": round(served.wall_s, 4),
            "audio_s": round(audio_s, 3), "rtf": round(served.wall_s / max(audio_s, 1e-9), 4),
            "text_tokens": len(out.text.token_ids), "node_s": {k: round(v, 4) for k, v in out.metrics.node_s.items()}}


def summary(runs: list[Served], firsts: list[float], wall: float, n: int) -> dict:
    audio = sum(audio_seconds(r) for r in runs)
    return {"requests": n, "wall_s": round(wall, 4), "audio_s": round(audio, 3), "audio_s_per_s": round(audio / wall, 3),
            "first_audio_s_p50": round(statistics.median(firsts), 4), "steps_by_node": steps_by_node(runs)}


def run_one_at_a_time(pipeline: Pipeline, args, n: int) -> dict:
    runs = [serve(pipeline, [spoken_request(f"s{i}", args, i, stream=True)], args, check=check_answer) for i in range(n)]
    return summary(runs, [r.first_audio_s[f"s{i}"] for i, r in enumerate(runs)], sum(r.wall_s for r in runs), n)


def run_concurrent(pipeline: Pipeline, args, n: int) -> dict:
    served = serve(pipeline, [spoken_request(f"c{i}", args, i, stream=True) for i in range(n)], args, check=check_answer)
    return {**summary([served], list(served.first_audio_s.values()), served.wall_s, n),
            "steps": served.steps, "batched_steps": served.batched_steps}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tiny", action="store_true", help="CPU smoke: the family tests' tiny checkpoint")
    which.add_argument("--checkpoint", default=None, help="a Qwen3OmniMoeForConditionalGeneration folder")
    p.add_argument("--only", nargs="+", choices=("transformers", "single", "concurrent"),
                   default=["transformers", "single", "concurrent"])
    p.add_argument("--text-tokens", type=int, default=None, help="text tokens at most (tiny: 8, else 64)")
    p.add_argument("--audio-frames", type=int, default=None, help="speech frames at most (tiny: 12, else 256)")
    p.add_argument("--batches", default="4", help="concurrent answers, comma-separated (e.g. 8,32)")
    p.add_argument("--serial", type=int, default=2, help="answers run one at a time for the baseline")
    p.add_argument("--iters", type=int, default=2, help="batch-1 runs per side (the fastest is reported: warm)")
    p.add_argument("--device", default=None, help="cuda (default when there is one; cpu with --tiny) or cpu")
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.text_tokens = args.text_tokens or (8 if args.tiny else 64)
    args.audio_frames = args.audio_frames or (12 if args.tiny else 256)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sink = open(args.out, "a") if args.out else None
    scratch = Path(tempfile.mkdtemp(prefix="qwen3_omni_bench_")) if args.tiny else None
    import transformers
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    base = {"bench": "qwen3_omni", "arch": "tiny" if args.tiny else str(args.checkpoint), "greedy": True,
            "max_text_tokens": args.text_tokens, "max_audio_frames": args.audio_frames,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        if scratch is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.models.qwen3_omni.checkpoint import save_omni3_checkpoint

            save_omni3_checkpoint(scratch, seed=0)
        folder = scratch or Path(args.checkpoint)
        if "transformers" in args.only:
            hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
            tokenizer = AutoTokenizer.from_pretrained(folder)
            with torch.inference_mode():
                run_transformers(hf, tokenizer, args, device)  # warm
                runs = [run_transformers(hf, tokenizer, args, device) for _ in range(args.iters)]
            emit({**base, "metric": "transformers_generate", "batch": 1, "streamed": False,
                  **min(runs, key=lambda r: r["total_s"])}, sink)
            del hf
        if {"single", "concurrent"} & set(args.only):
            t0 = time.perf_counter()
            _, pipeline = load_pipeline(folder, LoadOptions(device=device, dtype=dtype))
            emit({**base, "metric": "load_s", "value": round(time.perf_counter() - t0, 2)}, sink)
            ours_records(pipeline, args, base, sink, single=run_single, one_at_a_time=run_one_at_a_time,
                         concurrent=run_concurrent)
    finally:
        if sink:
            sink.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
