set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whlc/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 400 python3 benchmarks/bench_comfy.py --device cuda --templates .comfy --out $OUT/comfy_gpu.jsonl 2>&1 | grep -v -i "warn\|it/s" | tail -30
timeout 80 python3 benchmarks/bench_rl_consistency.py --device cuda --dtype bfloat16 --size 128 --frames 17 --group 8 --text-features .scratch/rl_prompt_features > $OUT/rl_consistency_gpu.jsonl; tail -c 1500 $OUT/rl_consistency_gpu.jsonl
# carry: .whl .whlc .comfy .scratch/rl_prompt_features (move shapes-interactive out first)
