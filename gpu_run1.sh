set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
W=$(cd benchmarks && python3 -c "import sys; sys.path.insert(0,'.'); from wan_random import save_random_wan; print(save_random_wan(size='full', device='cuda'))" | tail -1)
echo "W=$W"
timeout 120 python3 benchmarks/bench_engine.py --model $W --only overhead --out $OUT/engine_overhead_gpu.jsonl
timeout 170 python3 benchmarks/bench_decode_interleave.py --model $W --device cuda --dtype bfloat16 --large 480x832x81 --small 256x256x5 --steps 4 --out $OUT/decode_interleave_gpu.jsonl
timeout 110 python3 benchmarks/bench_flux.py --only e2e --steps 28 --out $OUT/flux_e2e_gpu.jsonl
timeout 110 python3 benchmarks/bench_cosmos3.py --only video --video-shape 480x832x33 --video-steps 8 --out $OUT/cosmos3_video_gpu.jsonl
