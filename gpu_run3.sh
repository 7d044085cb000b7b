set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 scripts/rl_payoff.py run --device cuda --text-features .scratch/rl_prompt_features --score-workers 14 --max-minutes 3.25 --total-minutes 8.0 --out $OUT
