"""Moving a run between machines: what a GPU call hands back, and restoring it elsewhere.

The device tool returns at most 8 files of at most 16 MiB each (64 MiB together, two folders
deep) from a call, so ``publish`` writes a flat, bounded set:

* ``meta.tar.gz``: every result, log, config, manifest and evaluation JSON of the work dir;
* ``vae.safetensors`` (fp32, 12 MB), ``dit.safetensors`` and ``distill.safetensors`` (bf16
  with the loader's fp32 tensors, 16.5 MB each: exactly the shipped transformer files) for
  the stages that have finished.

``restore`` rebuilds a work dir from them, so the run continues at the next unfinished
stage on a fresh machine, and ``export`` on any machine (a CPU is enough) reproduces the
shipped files bit for bit.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from omniloop.models.families.wan.weights import WEIGHTS_FILE, load_wan_dit
from omniloop.train.recipes.wan_checkpoint import save_wan_dit

META = "meta.tar.gz"
MAX_FILE_BYTES = 16 * 2**20
MODEL_DIR = "model"
PUBLISHED_EXPORT = "export_published"  # the GPU's export manifests, after a restore
# stage -> dtype its weights travel in (None: the file as trained)
STAGE_WEIGHTS = {"vae": None, "dit": torch.bfloat16, "distill": torch.bfloat16}
# results that mean nothing without data that does not travel (latent shards, trajectories)
_LOCAL_ONLY = ("latents/", "image_latents/", "trajectories/", "image_trajectories/", "_bench/")
GATE_SOURCE, GATE_PUBLISHED = Path("vae") / "gate.json", "vae_gate.json"  # the VAE's round-trip gate, in plain sight


def _meta_files(work: Path) -> list[Path]:
    return [p for p in sorted(work.rglob("*")) if p.is_file() and p.suffix in (".json", ".jsonl")
            and not p.name.startswith(".") and not str(p.relative_to(work)).startswith(_LOCAL_ONLY)]


def publish(work: Path, dest: Path) -> list[Path]:
    """Write ``meta.tar.gz`` and the finished stages' weights into ``dest`` (flat)."""
    work, dest = Path(work), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in _meta_files(work):
            tar.add(path, arcname=str(path.relative_to(work)))
    (dest / META).write_bytes(buffer.getvalue())
    written.append(dest / META)
    if (work / GATE_SOURCE).is_file():  # also inside meta.tar.gz; here to read without unpacking
        shutil.copy2(work / GATE_SOURCE, dest / GATE_PUBLISHED)
        written.append(dest / GATE_PUBLISHED)
    for stage, dtype in STAGE_WEIGHTS.items():
        folder = work / stage / MODEL_DIR
        if not (work / stage / "result.json").is_file() or not (folder / WEIGHTS_FILE).is_file():
            continue
        target = dest / f"{stage}.safetensors"
        if dtype is None:
            shutil.copy2(folder / WEIGHTS_FILE, target)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                save_wan_dit(load_wan_dit(folder, dtype=torch.float32), Path(tmp), dtype=dtype)
                shutil.copy2(Path(tmp) / WEIGHTS_FILE, target)
        assert target.stat().st_size <= MAX_FILE_BYTES, f"{target} is over the device tool's 16 MiB per file"
        written.append(target)
    return written


def restore(src: Path, work: Path) -> list[str]:
    """Unpack a ``publish`` folder into ``work``; returns the stages whose weights came back."""
    src, work = Path(src), Path(work)
    if not (src / META).is_file():
        raise FileNotFoundError(f"{src / META} not found; pass the folder a GPU call published into")
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src / META, mode="r:gz") as tar:
        tar.extractall(work, filter="data")
    exported = work / "export"
    if exported.is_dir():  # its manifests say what the GPU shipped and evaluated: kept to check a re-export
        shutil.rmtree(work / PUBLISHED_EXPORT, ignore_errors=True)
        exported.rename(work / PUBLISHED_EXPORT)
    restored = []
    for stage in STAGE_WEIGHTS:
        weights = src / f"{stage}.safetensors"
        if weights.is_file():
            (work / stage / MODEL_DIR).mkdir(parents=True, exist_ok=True)
            shutil.copy2(weights, work / stage / MODEL_DIR / WEIGHTS_FILE)
            restored.append(stage)
        elif (work / stage / "result.json").is_file():
            (work / stage / "result.json").unlink()  # finished there, but its weights did not travel
    return restored
