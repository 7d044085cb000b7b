set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 250 python3 benchmarks/bench_audio.py --only ltx2 --steps 30 --iters 1 --out $OUT/ltx2_30_gpu.jsonl
timeout 330 python3 benchmarks/bench_omni.py --out $OUT/omni_gpu.jsonl
