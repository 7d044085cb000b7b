#!/usr/bin/env bash
# Everything the test suite uses, into the active Python environment (a virtualenv):
#   bash scripts/install_dev.sh                       # torch 2.13.0 from the configured index
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install_dev.sh
#                                                     # the CPU-only build from PyTorch's index
# .ci/run calls this same script, so the README's install is what CI installs. Torch comes
# first and pinned: an unpinned torch pulled in by a dependency would be the default Linux
# wheel from PyPI, a multi-GB CUDA build that the CPU-only test suite never uses.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --upgrade pip
python -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
python -m pip install --quiet -e ".[test,serve,fleet]"
# Dynamo's Python package without its dependencies: one of them (aisimulate 0.13.0) is a
# wheel stub that downloads from pypi.nvidia.com at install time; the fleet extra above
# installs what the frontend and our worker import.
python -m pip install --quiet --no-deps "ai-dynamo==1.6.1"
# torchvision for the Qwen3-VL video-processor oracle only (tests/models/cosmos3/video_oracle.py):
# its registry wheels are CUDA builds whose _C needs libtorch_cuda, so it goes to a side folder
# that only that child process imports (on the venv's path it would break transformers' imports).
python -m pip install --quiet --no-deps --target .ci-torchvision "torchvision==0.28.0"
python -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
