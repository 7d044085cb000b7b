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
from omniloop.train.recipes.stage import require_done, source_tasks, stage_runs
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
        files=_records(teacher_dir, teacher_files), tasks=teacher_tasks(results[shapes_dit.STAGE], model),
        provenance={**made(teacher_stages), "validation": results[shapes_dit.STAGE].get("validation")})}
    shipped = [(teacher_dir, teacher_files)]
    if student:
        manifests[STUDENT_NAME] = model.student_manifest(
            vae_subfolder=shared_vae, files=_records(student_dir, student_files),
            tasks=tuple(results[shapes_distill.STAGE].get("tasks") or model.video_only()),
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


def teacher_tasks(dit_result: dict[str, Any], model: ShapesModelSettings) -> tuple[str, ...]:
    """T2I only for a teacher that trained on single frames: in this run (an image store), or
    before it (the shipped model it continued or adopted declares T2I)."""
    source = dit_result.get("init_from") or dit_result.get("adopted_from")
    learned = dit_result.get("images") is not None or "t2i" in source_tasks(source)
    return model.tasks if learned else model.video_only()


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



def install_vae(work_dir: Path, builtin_dir: Path, *, gate: dict[str, Any] | None = None,
                budget_bytes: int = BUDGET_BYTES) -> list[Path]:
    """Ship a decoder fine-tune's VAE (``work_dir/vae``, ``decoder_only``) in place of the
    built-in models' VAE, leaving both DiTs as they are: the file goes into
    ``<builtin>/shapes-t2v/vae`` (bf16) and both manifests get its file records and the
    VAE's run history (and ``gate``, the round-trip gate's figures, when given).

    Refused unless the encoder half is byte-identical to the shipped one (the DiTs were
    trained on its latents) and the latent statistics are the shipped ones."""
    from safetensors.torch import load_file

    result = require_done(Path(work_dir) / shapes_vae.STAGE, shapes_vae.STAGE)
    if not result.get("decoder_only"):
        raise ValueError(f"{work_dir}: its VAE is not a decoder fine-tune (decoder_only); a new encoder moves the "
                         f"latents the shipped DiTs were trained on: export and install the whole chain instead")
    teacher_dir = Path(builtin_dir) / TEACHER_NAME
    shipped_vae = teacher_dir / "vae"
    vae = load_wan_vae(Path(work_dir) / shapes_vae.STAGE / shapes_vae.MODEL_DIR, dtype=torch.float32)
    old = load_wan_vae(shipped_vae, dtype=torch.float32)
    if (vae.config.latents_mean, vae.config.latents_std) != (old.config.latents_mean, old.config.latents_std):
        raise ValueError("the fine-tuned VAE's latent statistics differ from the shipped VAE's: not a decoder fine-tune "
                         "of it")
    weights = "diffusion_pytorch_model.safetensors"
    before = load_file(str(shipped_vae / weights))
    staged = teacher_dir / ".vae_new"
    shutil.rmtree(staged, ignore_errors=True)
    save_wan_vae(vae, staged, dtype=torch.bfloat16)
    after = load_file(str(staged / weights))
    moved = [k for k in before if k.startswith(shapes_vae.ENCODER_PREFIXES) and not torch.equal(before[k], after[k])]
    if moved or before.keys() != after.keys():
        shutil.rmtree(staged)
        raise ValueError(f"the fine-tuned VAE's encoder differs from the shipped one ({moved[:3]}...): refusing to "
                         f"move the latents the shipped DiTs were trained on")
    shutil.rmtree(shipped_vae)
    staged.rename(shipped_vae)
    runs = stage_runs(result)
    finetune = {"steps": result.get("steps"), "clip_schedule": result.get("clip_schedule"), "encoder": "frozen",
                **({"gate": {k: gate[k] for k in ("passed", "threshold_db", "worst")}} if gate else {})}
    written = []
    for name, vae_rel in ((TEACHER_NAME, "vae"), (STUDENT_NAME, f"../{TEACHER_NAME}/vae")):
        model_dir = Path(builtin_dir) / name
        if not (model_dir / "omniloop_model.json").is_file():
            continue
        manifest = read_manifest(model_dir)
        files = dict(manifest.files)
        for f in ("config.json", weights):
            files[f"{vae_rel}/{f}"] = file_record((model_dir / vae_rel / f).resolve())
        provenance = dict(manifest.provenance)
        provenance["steps_by_run"] = {**provenance.get("steps_by_run", {}), shapes_vae.STAGE: runs}
        provenance["steps"] = {**provenance.get("steps", {}), shapes_vae.STAGE: sum(runs)}
        provenance["vae_decoder_finetune"] = finetune
        write_manifest(model_dir, manifest.model_copy(update={"files": files, "provenance": provenance}))
        written.append(model_dir)
    unique = {(Path(builtin_dir) / n / rel).resolve() for n in (TEACHER_NAME, STUDENT_NAME)
              if (Path(builtin_dir) / n / "omniloop_model.json").is_file()
              for rel in read_manifest(Path(builtin_dir) / n).files}
    total = sum(p.stat().st_size for p in unique)
    assert total <= budget_bytes, f"installed weights take {total / 1e6:.2f} MB, over the {budget_bytes / 1e6:.0f} MB budget"
    return written
