# Issue 16 point 6: train the interactive shapes-world model (shapes-interactive) on one H200.
# Run from the checkout the device copies (the repository root).
# Needs, locally, once:  python scripts/train_shapes.py pack-minilm   (writes .scratch/minilm_pack, 2 parts)
# and the pydantic wheels for Python 3.12 in .whl/ (the GPU machine lacks pydantic).
#
# Calls each within ~30 s of the last (the machine stays warm and keeps /tmp and the carried paths).
# Since shapes-interactive ships (2026-12-02) the tracked tree is ~60 MB and tree + carry must stay
# under 64 MiB (67.1 MB): write the pack in 8 parts (`train_shapes.py pack-minilm --pack-parts 8`,
# ~5.6 MB each) and carry one part a call (calls 2a-2h), the pydantic wheels (2.6 MB, not the
# diffusers one) with the pack's small files in call 1. Check first: git ls-files | xargs du -cb | tail -1
# (the 2026-12-02 run below still had a 43 MB tree: 2 parts, 3 carry calls).
# The training runs in the background (setsid) from a copy of the tree in /tmp/repo, so it outlives a
# call's 10-minute limit; calls 3 and 4 wait for it. Run of 2026-12-02: --max-minutes 12
# --student-minutes 3 (teacher 448 steps of 1,024 clips in 500 s, 1.1 s a step; 82.0% action accuracy;
# student 78.5%), ~13.5 device-minutes for calls 3-4.
#
# call 1: run kind=nvidia-h200 timeout_s=120 carry=[the five pydantic-set wheels in .whl/, and the pack's
#   config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.txt]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo wheels-ok
#
# calls 2a..2h: run timeout_s=30 carry=[".scratch/minilm_pack/minilm_pack-0000K-of-00008.safetensors"], K = 1..7
ls -la .scratch/minilm_pack
#
# call 3: run timeout_s=590 carry=[".scratch/minilm_pack/minilm_pack-00008-of-00008.safetensors"]
# (add --init-teacher <folder> to resume from a saved teacher: carry its 4 files in call 2 or 3)
# Next run, planned 2026-12-05 (no machine came that day): start the teacher from the shipped student
# (in the tree: no carry) with chunk 0 weighted 3 (the default since 8f26a10: 8 of 128 held-out
# sessions of the shipped model are blank from their first frame), a longer student:
#   train ... --init-teacher src/omniloop/models/builtin/shapes-interactive/transformer --lr 2e-4 --steps 640
#   --max-minutes 17 --student-minutes 5 --student-steps 220   (~22 device-minutes with calls 1-2h)
# (Since 2026-12-05 the shipped student reaches the 90% target at its served defaults: chunk 0 at 6
# steps and guidance 4, scripts/train_interactive.py SERVED. A retrained student is installed with
# the same defaults; re-choose them on seed 5 (docs/training.md) before reading seeds 3 and 7.)
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1; rm -rf /tmp/repo /tmp/inter; cp -r . /tmp/repo && cd /tmp/repo && mkdir -p /tmp/inter && (setsid nohup bash -c 'python3 scripts/train_interactive.py train --text-encoder .scratch/minilm_pack --max-minutes 12 --student-minutes 3 --install --out /tmp/inter > /tmp/train.log 2>&1; python3 benchmarks/bench_causal.py --shapes --text-encoder .scratch/minilm_pack --sessions 1,4,16 --out /tmp/inter/causal_shapes_h200.jsonl > /tmp/bench.log 2>&1; touch /tmp/inter/ALLDONE' > /dev/null 2>&1 &) ; for i in $(seq 565); do [ -f /tmp/inter/ALLDONE ] && break; sleep 1; done; grep -v Loading /tmp/train.log | tail -12 | cut -c1-330
#
# call 4: run timeout_s=420 (no carry): wait, then bring back the student export, result.json, the bench
# JSON and the log (8 files: the most the device tool returns)
for i in $(seq 400); do [ -f /tmp/inter/ALLDONE ] && break; sleep 1; done; tail -3 /tmp/bench.log | cut -c1-400; cp -r /tmp/inter/model $OUT/ && cp /tmp/inter/result.json $OUT/; cp /tmp/inter/causal_shapes_h200.jsonl $OUT/ 2>/dev/null; cp /tmp/train.log $OUT/model/train.log; ls -R $OUT
#
# call 5 (optional, timeout_s=30): the teacher, to resume from next time (not shipped)
cp -r /tmp/inter/teacher $OUT/
#
# Back here (files_at = call 4's returned folder):
#   python scripts/train_interactive.py install <files_at>     # -> src/omniloop/models/builtin/shapes-interactive
#   python -m pytest -q tests/test_shipped_interactive.py
#   python benchmarks/bench_causal.py --shapes --out benchmarks/results/causal_shapes_cpu.jsonl   # CPU figures
#   copy <files_at>/causal_shapes_h200.jsonl to benchmarks/results/
