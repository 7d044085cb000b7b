set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 420 python3 benchmarks/bench_families.py --only flux,ltx2,stable_audio --modes diffusers,diffusers_compiled,ours_default --out $OUT/families_fastpath_gpu.jsonl 2>&1 | grep -v Warning | tail -30
timeout 150 python3 benchmarks/bench_ti2v_modulation_memory.py --five-b --out $OUT/ti2v_modulation_gpu.jsonl 2>&1 | tail -15
