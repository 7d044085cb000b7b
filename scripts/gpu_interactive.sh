# Issue 16 point 6: train the interactive shapes-world model (shapes-interactive) on one H200.
# Run from the checkout the device copies (the repository root).
# Needs, locally, once:  python scripts/train_shapes.py pack-minilm   (writes .scratch/minilm_pack, 2 parts)
# and the pydantic wheels for Python 3.12 in .whl/ (the GPU machine lacks pydantic).
#
# Four calls, each within ~30 s of the last (the machine stays warm and keeps /tmp and the carried
# paths). The tree is ~43 MB and tree + carry must stay under 64 MiB, so the wheels and the pack's two
# parts travel one call each. An untracked model folder in the tree counts too: move
# src/omniloop/models/builtin/shapes-interactive away while a call carries.
# The training runs in the background (setsid) from a copy of the tree in /tmp/repo, so it outlives a
# call's 10-minute limit; calls 3 and 4 wait for it. Run of 2026-12-02: --max-minutes 12
# --student-minutes 3 (teacher 448 steps of 1,024 clips in 500 s, 1.1 s a step; 82.0% action accuracy;
# student 78.5%), ~13.5 device-minutes for calls 3-4.
#
# call 1: run kind=nvidia-h200 timeout_s=120 carry=[".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo wheels-ok
#
# call 2: run timeout_s=60 carry=[".scratch/minilm_pack/minilm_pack-00001-of-00002.safetensors"]
ls -la .scratch/minilm_pack
#
# call 3: run timeout_s=590 carry=[".scratch/minilm_pack/minilm_pack-00002-of-00002.safetensors",
#   ".scratch/minilm_pack/config.json", ".scratch/minilm_pack/tokenizer.json", ".scratch/minilm_pack/tokenizer_config.json",
#   ".scratch/minilm_pack/special_tokens_map.json", ".scratch/minilm_pack/vocab.txt"]
# (add --init-teacher <folder> to resume from a saved teacher: carry its 4 files in call 2 or 3)
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
