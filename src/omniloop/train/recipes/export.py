"""Recipe step: trained stage outputs -> the shipped models, in our manifest layout.

Writes ``<out>/shapes-t2v`` (teacher DiT + VAE) and ``<out>/shapes-t2v-4step`` (student DiT;
its manifest points at the teacher's VAE folder, ``../shapes-t2v/vae``, so the one VAE file
ships once). Weights are bf16, except the DiT tensors every loader keeps in fp32. The sum of
the unique weight files of both models is checked against the package budget (40 MB), and
every file's size and sha256 go into the manifests, so a truncated shipped file fails at
load naming the file. Copy both folders into ``src/omniloop/models/builtin/`` to ship them
(``scripts/train_shapes.py export --install``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.models.manifest import ModelManifest, file_record, read_manifest, write_manifest
from omniloop.train.recipes import shapes_distill, shapes_dit, shapes_vae
from omniloop.train.recipes.shapes_model import STUDENT_NAME, TEACHER_NAME, ShapesModelSettings
from omniloop.train.recipes.stage import require_done, stage_runs
from omniloop.train.recipes.wan_checkpoint import save_wan_dit, save_wan_vae

BUDGET_BYTES = 40_000_000  # package data: every shipped weight file together (decimal MB)
STAGE = "export"


@dataclass(frozen=True)
class ExportReport:
    root: Path
    models: dict[str, dict[str, Any]]  # name -> {"dir", "params", "files"}
    total_bytes: int
    budget_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "models": self.models, "total_bytes": self.total_bytes,
                "total_mb": round(self.total_bytes / 1e6, 2), "budget_mb": self.budget_bytes / 1e6}


def _records(model_dir: Path, rels: list[str]) -> dict[str, Any]:
    return {rel: file_record((model_dir / rel).resolve()) for rel in rels}


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def export_shapes(work_dir: Path, out_root: Path, model: ShapesModelSettings, *, student: bool = True,
                  budget_bytes: int = BUDGET_BYTES, provenance: dict[str, Any] | None = None) -> ExportReport:
    """Export the finished VAE, teacher and (``student=True``) student of ``work_dir`` into
    ``out_root``. ``student=False`` exports the teacher alone, before a distillation exists:
    the 50-step model ships and serves while the student is still to be trained."""
    work_dir, out_root = Path(work_dir), Path(out_root)
    stages = (shapes_vae.STAGE, shapes_dit.STAGE) + ((shapes_distill.STAGE,) if student else ())
    results = {stage: require_done(work_dir / stage, stage) for stage in stages}
    teacher_dir, student_dir = out_root / TEACHER_NAME, out_root / STUDENT_NAME
    for d in (teacher_dir, student_dir):
        if d.exists():
            shutil.rmtree(d)
    vae = load_wan_vae(work_dir / shapes_vae.STAGE / shapes_vae.MODEL_DIR, dtype=torch.float32)
    teacher = load_wan_dit(work_dir / shapes_dit.STAGE / shapes_dit.MODEL_DIR, dtype=torch.float32)
    save_wan_vae(vae, teacher_dir / "vae", dtype=torch.bfloat16)
    save_wan_dit(teacher, teacher_dir / "transformer", dtype=torch.bfloat16)
    if student:
        student_dit = load_wan_dit(work_dir / shapes_distill.STAGE / shapes_dit.MODEL_DIR, dtype=torch.float32)
        save_wan_dit(student_dit, student_dir / "transformer", dtype=torch.bfloat16)

    component_files = ("config.json", "diffusion_pytorch_model.safetensors")
    shared_vae = f"../{TEACHER_NAME}/vae"
    teacher_files = [f"{c}/{f}" for c in ("transformer", "vae") for f in component_files]
    student_files = [f"transformer/{f}" for f in component_files] + [f"{shared_vae}/{f}" for f in component_files]

    def made(names: tuple[str, ...]) -> dict[str, Any]:  # the training behind one model (the teacher: no distill)
        runs = {stage: stage_runs(results[stage]) for stage in names}
        return {"recipe": "omniloop.train.recipes via scripts/train_shapes.py (docs/training.md)",
                "steps": {stage: sum(r) for stage, r in runs.items()}, "steps_by_run": runs, **(provenance or {})}

    teacher_stages = (shapes_vae.STAGE, shapes_dit.STAGE)
    manifests = {TEACHER_NAME: model.teacher_manifest(
        files=_records(teacher_dir, teacher_files),
        provenance={**made(teacher_stages), "validation": results[shapes_dit.STAGE].get("validation")})}
    shipped = [(teacher_dir, teacher_files)]
    if student:
        manifests[STUDENT_NAME] = model.student_manifest(
            vae_subfolder=shared_vae, files=_records(student_dir, student_files),
            provenance={**made((*teacher_stages, shapes_distill.STAGE)), "teacher": TEACHER_NAME,
                        "trajectories": results[shapes_distill.STAGE].get("trajectories"),
                        "validation": results[shapes_distill.STAGE].get("validation")})
        shipped.append((student_dir, student_files))
    unique = {(d / rel).resolve() for d, rels in shipped for rel in rels}
    total = sum(p.stat().st_size for p in unique)
    if total > budget_bytes:
        raise ValueError(f"exported weights take {total / 1e6:.2f} MB, over the {budget_bytes / 1e6:.0f} MB package "
                         f"budget (teacher DiT {_params(teacher) / 1e6:.2f}M"
                         f"{f', student {_params(student_dit) / 1e6:.2f}M' if student else ''}, "
                         f"VAE {_params(vae) / 1e6:.2f}M params); shrink the DiT or VAE recipe")
    for name, manifest in manifests.items():
        write_manifest(out_root / name, manifest)  # last: a model without its manifest does not load
    models = {TEACHER_NAME: {"dir": str(teacher_dir), "params": {"transformer": _params(teacher), "vae": _params(vae)},
                             "files": {k: v.bytes for k, v in manifests[TEACHER_NAME].files.items()}}}
    if student:
        models[STUDENT_NAME] = {"dir": str(student_dir), "params": {"transformer": _params(student_dit), "vae": "shared"},
                                "files": {k: v.bytes for k, v in manifests[STUDENT_NAME].files.items()}}
    return ExportReport(out_root, models, total, budget_bytes)


def install(out_root: Path, builtin_dir: Path) -> list[Path]:
    """Copy the exported models over the built-in placeholders: both (they ship together: the
    student reads the teacher's VAE folder), or the teacher alone when no student was
    exported (the student's placeholder stays)."""
    installed = []
    names = (TEACHER_NAME, STUDENT_NAME) if (Path(out_root) / STUDENT_NAME).is_dir() else (TEACHER_NAME,)
    for name in names:
        manifest: ModelManifest = read_manifest(Path(out_root) / name)
        if not manifest.files:
            raise ValueError(f"{Path(out_root) / name} lists no weight files; export it first")
        target = Path(builtin_dir) / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(Path(out_root) / name, target)
        installed.append(target)
    return installed

