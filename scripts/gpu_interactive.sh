# Issue 16 point 6: train the interactive shapes-world model (shapes-interactive) on one H200.
# Run from the checkout the device copies (the repository root).
# Needs, locally, once:  python scripts/train_shapes.py pack-minilm   (writes .scratch/minilm_pack, 2 parts)
# and the pydantic wheels for Python 3.12 in .whl/ (the GPU machine lacks pydantic; diffusers wheel is NOT carried).
#
# Three calls within ~30 s of each other (carried paths stay on the warm machine; the tree is ~43 MB and
# tree + carry must stay under 64 MiB, so the wheels, part 1 and part 2 of the pack travel one call each).
# Expected device time: calls 1-2 ~10 s each (after the machine's ~90 s start), call 3 ~500 s (<= 540):
# imports ~20 s; data ~30 s; the teacher trains until 4.0 min from the start (--max-minutes 6.5 minus
# --student-minutes 2.5), 32 validation sessions at 6 steps ~25 s; the 2-step student gets 2.5 min: teacher
# sessions recorded through ChunkRollout in waves of 512 (at most half of it), segment distillation with an
# early stop on 64 held-out sessions until the 2.5 min are up, 32 validation sessions at 2 steps ~20 s; export
# ~5 s; H200 bench of the installed student ~40 s (the last thing: a timeout there loses only the bench).
#
# call 1: run kind=nvidia-h200 timeout_s=120 carry=[".whl/pydantic-2.13.5-py3-none-any.whl",
#   ".whl/pydantic_core-2.46.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
#   ".whl/annotated_types-0.8.0-py3-none-any.whl", ".whl/typing_extensions-4.16.0-py3-none-any.whl",
#   ".whl/typing_inspection-0.4.5-py3-none-any.whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo wheels-ok
#
# call 2: run kind=nvidia-h200 timeout_s=60 carry=[".scratch/minilm_pack/minilm_pack-00001-of-00002.safetensors"]
ls -la .scratch/minilm_pack
#
# call 3: run kind=nvidia-h200 timeout_s=540 carry=[".scratch/minilm_pack/minilm_pack-00002-of-00002.safetensors",
#   ".scratch/minilm_pack/config.json", ".scratch/minilm_pack/tokenizer.json", ".scratch/minilm_pack/tokenizer_config.json",
#   ".scratch/minilm_pack/special_tokens_map.json", ".scratch/minilm_pack/vocab.txt"]
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 && python3 scripts/train_interactive.py train --text-encoder .scratch/minilm_pack --max-minutes 6.5 --student-minutes 2.5 --steps 450 --install --out $OUT > /tmp/train.log 2>&1; tail -4 /tmp/train.log; python3 benchmarks/bench_causal.py --shapes --text-encoder .scratch/minilm_pack --sessions 1,4,16 --out $OUT/causal_shapes_h200.jsonl > /tmp/bench.log 2>&1; tail -4 /tmp/bench.log
#
# The logs stay in /tmp (only their tails print): the device tool returns at most 8 files, and the export
# (manifest, config, 2 shards, index), result.json and the bench's JSON are 7.
# Back here (files_at = the call's returned folder):
#   python scripts/train_interactive.py install <files_at>     # -> src/omniloop/models/builtin/shapes-interactive
#   python -m pytest -q tests/test_shipped_interactive.py                  # un-skips: accuracy of the shipped model
#   python benchmarks/bench_causal.py --shapes --out benchmarks/results/causal_shapes_cpu.jsonl   # CPU figures of the shipped model
# (call 3 also benchmarks the freshly installed model on the H200: $OUT/causal_shapes_h200.jsonl, ~40 s;
#  copy it to benchmarks/results/causal_shapes_h200.jsonl)
