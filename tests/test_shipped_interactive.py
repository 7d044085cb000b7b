"""The shipped interactive model (shapes-interactive: the 2-step student of the 6-step teacher):
action following, chunk by chunk, of live sessions on the engine at its defaults (2 steps
a chunk without guidance; chunk 0 at 6 steps and guidance 4), its size budget and its
provenance. Issue 16 point 7 targets >= 90%: at these defaults the model follows 91.2% and 91.0%
of two held-out sets' 1,024 chunks (docs/training.md); 16 sessions measure 91.4%.
Skips until GPU-trained weights are installed (scripts/train_interactive.py install)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.loader import BUILTIN_DIR, BUILTIN_MODELS, INTERACTIVE_MODEL
from omniloop.models.manifest import read_manifest

FLOOR = 0.84  # measured 0.914 on the 16 sessions below (0.836 before chunk 0 had its own steps and guidance)

pytestmark = pytest.mark.skipif(INTERACTIVE_MODEL not in BUILTIN_MODELS, reason=f"{INTERACTIVE_MODEL} is not installed "
                                "(train it: scripts/gpu_interactive.sh, then scripts/train_interactive.py install)")


def test_the_shipped_interactive_model_is_small():
    folder = BUILTIN_DIR / INTERACTIVE_MODEL
    own = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert own <= 25e6, f"{own / 1e6:.1f} MB: over the 25 MB budget"
    manifest = read_manifest(folder)
    assert manifest.components["vae"].subfolder == "../shapes-t2v/vae"  # shares the shipped VAE
    # the shipped model is the 2-step student; its provenance records both models' steps and accuracy
    assert manifest.defaults["steps"] == 2 == manifest.provenance["student"]["sample_steps"]
    assert manifest.provenance["teacher"]["sample_steps"] == 6
    for model in ("teacher", "student"):
        assert manifest.provenance[model]["steps"] > 0 and 0 <= manifest.provenance[model]["validation"]["action_accuracy"] <= 1


@pytest.mark.slow
def test_the_shipped_interactive_model_follows_actions():
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.train.recipes.interactive import action_accuracy

    pipeline = load_pipeline(INTERACTIVE_MODEL, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    assert pipeline.defaults.guidance_scale == 1.0  # real time on 2 cores (docs/training.md)
    assert (pipeline.defaults.first_chunk_guidance_scale, pipeline.defaults.first_chunk_steps) == (4.0, 6)
    report, _ = action_accuracy(pipeline, 16, 9, steps=None, size=pipeline.defaults.height, max_batch=16)
    assert report.n == 128
    # chance is ~0.2; the untrained init ignores actions (2.7% on the H200)
    assert report.accuracy >= FLOOR, report.summary()
