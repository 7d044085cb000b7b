"""The CUDA-graph defaults ``DeployConfig`` and ``LoadOptions`` show, apart from
``cuda_graphs.py`` so that reading them (the CLI's ``--help``) does not import torch."""

from __future__ import annotations

DEFAULT_MAX_GRAPHS = 8
DEFAULT_MAX_TOKENS = 16384  # FLUX.1-dev: 16 x 256x256 images with 512 text tokens each is 12,288
