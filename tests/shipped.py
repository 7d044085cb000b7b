"""Which shipped weights are in the tree (tests that hold the shipped models to a bar)."""

from __future__ import annotations

from omniloop.models.loader import BUILTIN_DIR
from omniloop.models.manifest import file_record

SHIPPED_VAE = BUILTIN_DIR / "shapes-t2v" / "vae"
# the session-5 VAE (trained on 9-frame clips): its 17-frame round trip collapses at frames 13-16
SESSION5_VAE_SHA256 = "007be595a8bb6bb9e8fe01551f3b9d5d1aafdd3142adbb5009446decfa9f655a"
SHIPS_SESSION5_VAE = file_record(SHIPPED_VAE / "diffusion_pytorch_model.safetensors").sha256 == SESSION5_VAE_SHA256
SESSION5_REASON = ("the session-5 VAE collapses at frames 13-16 (~11 dB); passes once issue 15's decoder fine-tune "
                   "ships (scripts/train_shapes.py install-vae, docs/training.md)")
