"""The RL payoff run (train/recipes/rl_payoff.py) end to end on a tiny shapes-layout model: stored
prompt features, before/after evaluations, FlowGRPO and DiffusionNFT through the engine, the
exported weights in the shipped layout loading back, the contact sheet and the provenance."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from omniloop.eval.adherence import evaluate_clip
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.models.families.wan.model import WanDiT
from omniloop.models.manifest import file_record, read_manifest, write_manifest
from omniloop.request import OmniRequest, TextPart
from omniloop.train.recipes.prompt_features import load_prompt_features, write_prompt_features
from omniloop.train.recipes.shapes_dit import DiTRecipe
from omniloop.train.recipes.shapes_model import ShapesModelSettings
from omniloop.train.recipes.shapes_vae import VAERecipe, vae_init_
from omniloop.train.recipes.wan_checkpoint import save_wan_dit, save_wan_vae
from omniloop.train.rl.objectives import diffusion_nft as rl_payoff_nft
from omniloop.train.rl.rewards import ClipCache, WeightedReward
from omniloop.train.rl.trajectory import Trajectory
from tests.train.rl.conftest import latent_mean_scorer

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "rl_payoff.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("rl_payoff", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_payoff"] = module  # its dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


rl_payoff = _load_script()
FILES = ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
         "vae/diffusion_pytorch_model.safetensors")
TINY = ["--train-two", "3", "--train-one", "1", "--eval-two", "2", "--eval-one", "1", "--size", "32", "--frames", "5",
        "--steps", "3", "--sde-window", "2", "--sde-range", "3", "--eval-steps", "2", "--group-size", "2",
        "--groups", "2", "--contact-two", "1", "--contact-one", "1"]


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    """A shapes-layout model folder (manifest, bf16 files) around a random 2-layer DiT and toy VAE."""
    torch.manual_seed(0)
    dit = WanDiT(DiTRecipe.toy().dit_config)
    with torch.no_grad():  # a non-zero output head: rollouts of one prompt differ, so groups have variance
        for p in dit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    root = tmp_path / "tiny-shapes"
    save_wan_dit(dit, root / "transformer", dtype=torch.bfloat16)
    save_wan_vae(vae_init_(WanVAE(VAERecipe.toy().vae_config)), root / "vae", dtype=torch.bfloat16)
    settings = ShapesModelSettings(height=32, width=32, num_frames=5, steps=3)
    write_manifest(root, settings.teacher_manifest("tiny-shapes", files={f: file_record(root / f) for f in FILES},
                                                   tasks=("t2v",)))
    return root


def test_prompt_sets_are_disjoint_and_fully_stated():
    sets = rl_payoff.payoff_prompts(rl_payoff.PayoffConfig(train_two=12, train_one=4, eval_two=16, eval_one=8))
    assert len(sets.train) == 16 and len(set(sets.train)) == 16
    assert not set(sets.train) & {i.prompt for i in sets.eval_two + sets.eval_one}
    # the two-object set is evaluate.py's --two-objects set (held_out_prompts(n, seed + 1), seeds 100_000 + i)
    assert [i.seed for i in sets.eval_two[:3]] == [100_000, 100_001, 100_002]
    assert all(rl_payoff._fully_stated(p, 2) for p in sets.train[:12])
    assert all(rl_payoff._fully_stated(p, 1) for p in sets.train[12:])


def test_prompt_features_equal_the_encoder_rounded_to_bf16(minilm, tmp_path):
    prompts = ["a red circle moving right and a blue square moving up", "a green star", ""]
    write_prompt_features(prompts, minilm, tmp_path)
    stored = load_prompt_features(tmp_path)
    got, want = stored.encode(prompts), minilm.encode(prompts)
    assert got.lengths == want.lengths and got.embeds.shape == want.embeds.shape
    assert torch.equal(got.embeds, want.embeds.to(torch.bfloat16).float())  # zero past each length too
    with pytest.raises(ValueError, match="not in the stored prompt features"):
        stored.encode(["a purple hexagon"])


def test_clip_cache_fill_scores_on_an_executor():
    video = np.zeros((5, 32, 32, 3), dtype=np.uint8)
    trajs = [Trajectory(request=OmniRequest(task="t2v", inputs=[TextPart(text="a red circle")]), prompt="a red circle",
                        group=0, video=torch.from_numpy(video.copy())) for _ in range(2)]
    cache = ClipCache()
    with ThreadPoolExecutor(2) as pool:
        cache.fill(trajs, pool)
    assert all(cache._holds(t) for t in trajs)
    assert cache.clip(trajs[0]).to_dict() == evaluate_clip(video, "a red circle").to_dict()


def test_payoff_run_writes_its_outputs_and_the_weights_load_back(tiny_model, minilm, tmp_path):
    feats, out = tmp_path / "features", tmp_path / "out"
    cfg = rl_payoff.PayoffConfig(model=str(tiny_model), train_two=3, train_one=1, eval_two=2, eval_one=1)  # TINY's
    write_prompt_features(rl_payoff.payoff_prompts(cfg).all_prompts(""), minilm, feats)
    # no validation (--val-every 0): the last weights are exported, no improved verdict (a random tiny model learns
    # no adherence: its groups have no variance, so no update runs, and materialize would refuse a run that checked)
    assert rl_payoff.main(["run", "--model", str(tiny_model), *TINY, "--iterations", "2", "--val-every", "0",
                           "--text-features", str(feats), "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["prompts"] == {"train": 4, "train_two": 3, "train_one": 1, "eval_two": 2, "eval_one": 1,
                                 "disjoint": True}
    for key in ("whole_prompt", "both_motions", "both_shapes", "count", "stable"):
        assert key in result["before"]["two_objects"]
    shipped = tiny_model / rl_payoff.TRANSFORMER_FILE
    provenance = json.loads((out / "provenance.json").read_text())
    for method in rl_payoff.METHODS:
        m = result["methods"][method]
        assert m["iterations"] >= 1 and m["rollouts"] == 4 * m["iterations"] and m["log"]
        assert set(m["targets_met"]) >= {"whole_prompt", "both_motions", "both_shapes", "stability_not_worse"}
        weights = out / f"{method}.safetensors"
        assert weights.stat().st_size == shipped.stat().st_size == m["weights"]["bytes"]
        assert _layout(weights) == _layout(shipped)  # same names, shapes and dtypes as the shipped file
        assert provenance[method]["method"] == method and provenance[method]["rollouts"] == m["rollouts"]
        # a loadable model folder, its transformer equal to the file (the manifest records both)
        folder = tmp_path / f"model-{method}"
        assert rl_payoff.main(["materialize", "--weights", str(weights), "--to", str(folder), "--model",
                               str(tiny_model), "--provenance", str(out / "provenance.json"), "--method", method]) == 0
        assert read_manifest(folder).provenance["rl_payoff"]["method"] == method
        pipeline = rl_payoff.load_model(folder, "cpu", "float32", load_prompt_features(feats))
        with safe_open(str(weights), "pt") as f:
            key = "proj_out.weight"
            assert torch.equal(pipeline.components["transformer"].state_dict()[key].cpu(), f.get_tensor(key).float())
    # NFT trains a copy; FlowGRPO the engine's own module: both moved off the shipped weights
    assert result["methods"]["nft"]["iterations"] <= result["methods"]["flow_grpo"]["iterations"]  # same budget
    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.size[0] == 3 * (3 * 32 + 4) + 2 * 6  # before + 2 methods, 3 frames each
    assert sorted(p.name for p in out.iterdir()) == ["contact_sheet.png", "flow_grpo.safetensors", "nft.safetensors",
                                                     "provenance.json", "result.json"]
    # shipping: materialized over the model's own folder (built aside, then swapped in)
    assert rl_payoff.main(["materialize", "--weights", str(out / "nft.safetensors"), "--to", str(tiny_model),
                           "--model", str(tiny_model)]) == 0
    assert read_manifest(tiny_model).files[rl_payoff.TRANSFORMER_FILE] == file_record(out / "nft.safetensors")
    assert (tiny_model / "vae" / "diffusion_pytorch_model.safetensors").is_file()


STUDENT_FILES = ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
                 "../tiny-shapes/vae/config.json", "../tiny-shapes/vae/diffusion_pytorch_model.safetensors")
STUDENT_TINY = ["--train-two", "3", "--train-one", "1", "--eval-two", "2", "--eval-one", "1", "--size", "32", "--frames",
                "5", "--group-size", "2", "--groups", "2", "--contact-two", "1", "--contact-one", "1"]


@pytest.fixture
def tiny_student(tiny_model) -> Path:
    """A student-layout folder beside ``tiny_model``: fixed sigmas, guidance 1, flow_euler, the teacher's
    VAE shared through ``../tiny-shapes/vae`` (the shipped shapes-t2v-4step's layout)."""
    root = tiny_model.parent / "tiny-shapes-4step"
    (root / "transformer").mkdir(parents=True)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        (root / "transformer" / name).write_bytes((tiny_model / "transformer" / name).read_bytes())
    settings = ShapesModelSettings(height=32, width=32, num_frames=5)
    write_manifest(root, settings.student_manifest("tiny-shapes-4step", vae_subfolder="../tiny-shapes/vae",
                                                   files={f: file_record(root / f) for f in STUDENT_FILES},
                                                   tasks=("t2v",)))
    return root


def test_the_student_run_rls_its_served_4_step_rollouts_and_ships_in_place(tiny_student, minilm, tmp_path):
    """``--model`` a fixed-schedule model: its preset (NFT alone, the served 4 sigmas and guidance 1 for
    rollouts and both evaluations, NFT's noise levels drawn among those sigmas), ``nft_student.safetensors``
    in the shipped layout, an exported folder that loads on its own, and materialize over the student's own
    folder keeping the shared VAE where it is."""
    feats, out = tmp_path / "features", tmp_path / "out"
    cfg = rl_payoff.PayoffConfig.for_model(str(tiny_student), train_two=3, train_one=1, eval_two=2, eval_one=1)
    assert cfg.methods == ("nft",) and cfg.steps is None and cfg.nft_timesteps == "served"
    served = rl_payoff.served_sigmas(tiny_student)
    assert served == pytest.approx((1.0, 0.9, 0.75, 0.5)) and rl_payoff.served_sigmas(tiny_student.parent / "tiny-shapes") is None
    write_prompt_features(rl_payoff.payoff_prompts(cfg).all_prompts(""), minilm, feats)
    seen: list[tuple[int | None, list[float] | None, float | None]] = []
    drawn: list[torch.Tensor] = []
    real_run, real_levels = rl_payoff.LibraryClient.run, rl_payoff_nft.noise_levels

    def recording_run(self, requests):
        seen.extend((r.diffusion.steps, r.diffusion.sigmas, r.diffusion.guidance_scale) for r in requests)
        return real_run(self, requests)

    def recording_levels(config, n, generator):
        drawn.append(real_levels(config, n, generator))
        return drawn[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_payoff.LibraryClient, "run", recording_run)
        mp.setattr(rl_payoff_nft, "noise_levels", recording_levels)
        # a random tiny model scores 0 on adherence (zero-variance groups, no update): a reward that varies
        mp.setattr(rl_payoff, "adherence_reward", lambda *a, **k: WeightedReward([(latent_mean_scorer(), 1.0)]))
        assert rl_payoff.main(["run", "--model", str(tiny_student), *STUDENT_TINY, "--iterations", "1",
                               "--minibatches", "1", "--val-every", "0", "--text-features", str(feats), "--out", str(out),
                               "--work", str(tmp_path / "work")]) == 0
    # every rollout request leaves steps / sigmas / guidance to the model (its validator fills the 4 sigmas)
    assert seen and set(seen) == {(None, None, 1.0)}
    assert drawn and set(torch.cat(drawn).tolist()) <= set(served)
    result = json.loads((out / "result.json").read_text())
    assert result["served_sigmas"] == pytest.approx(list(served)) and list(result["methods"]) == ["nft"]
    m = result["methods"]["nft"]
    assert m["iterations"] == 1 and m["rollouts"] == 4 and m["updates"] == 1, m
    shipped = tiny_student / rl_payoff.TRANSFORMER_FILE
    weights = out / "nft_student.safetensors"
    assert weights.stat().st_size == shipped.stat().st_size and _layout(weights) == _layout(shipped)
    assert sorted(p.name for p in out.iterdir()) == ["contact_sheet.png", "nft_student.safetensors",
                                                     "provenance.json", "result.json"]
    provenance = json.loads((out / "provenance.json").read_text())["nft"]
    assert provenance["rollout_sigmas"] == pytest.approx(list(served))
    assert provenance["config"]["nft_timesteps"] == "served" and provenance["config"]["steps"] is None
    # the evaluated export loads on its own (the shared VAE copied in)
    exported = tmp_path / "work" / "nft" / "tiny-shapes-4step"
    assert read_manifest(exported).components["vae"].subfolder == "vae" and (exported / "vae").is_dir()
    # shipping: over the student's own folder; the sibling VAE stays shared and untouched
    vae_file = tiny_student.parent / "tiny-shapes" / "vae" / "diffusion_pytorch_model.safetensors"
    vae_bytes = vae_file.read_bytes()
    assert rl_payoff.main(["materialize", "--weights", str(weights), "--to", str(tiny_student), "--model",
                           str(tiny_student), "--provenance", str(out / "provenance.json"), "--method", "nft"]) == 0
    manifest = read_manifest(tiny_student)
    assert manifest.components["vae"].subfolder == "../tiny-shapes/vae" and not (tiny_student / "vae").exists()
    assert manifest.files[rl_payoff.TRANSFORMER_FILE] == file_record(weights)
    assert manifest.files["../tiny-shapes/vae/diffusion_pytorch_model.safetensors"] == file_record(vae_file)
    assert vae_file.read_bytes() == vae_bytes and manifest.provenance["rl_payoff"]["method"] == "nft"
    assert manifest.defaults["sigmas"] == [1.0, 0.75, 0.5, 0.25]
    pipeline = rl_payoff.load_model(tiny_student, "cpu", "float32", load_prompt_features(feats))
    with safe_open(str(weights), "pt") as f:
        assert torch.equal(pipeline.components["transformer"].state_dict()["proj_out.weight"].cpu(),
                           f.get_tensor("proj_out.weight").float())


def test_the_student_preset_and_schedule_checks(tiny_model, tiny_student):
    assert rl_payoff.PayoffConfig.for_model(str(tiny_model)).methods == rl_payoff.METHODS  # the teacher's recipe
    both = rl_payoff.PayoffConfig.for_model(str(tiny_student), methods=("nft", "flow_grpo"))
    assert (both.sde_window, both.sde_range) == (1, 2)
    rl_payoff.check_schedule(both, rl_payoff.served_sigmas(tiny_student))
    with pytest.raises(ValueError, match="sde_range 8 exceeds the 4 rollout steps"):
        rl_payoff.check_schedule(dataclasses.replace(both, sde_range=8), rl_payoff.served_sigmas(tiny_student))
    with pytest.raises(ValueError, match="pass --nft-timesteps uniform"):
        rl_payoff.check_schedule(rl_payoff.PayoffConfig(model=str(tiny_model), nft_timesteps="served"), None)
    with pytest.raises(ValueError, match="nft_timesteps 'grid'"):
        rl_payoff.PayoffConfig(nft_timesteps="grid")


def test_a_run_refuses_features_of_other_prompts(tiny_model, minilm, tmp_path):
    write_prompt_features(["a red circle moving right", ""], minilm, tmp_path / "features")
    with pytest.raises(ValueError, match="lacks .* of this run's prompts"):
        rl_payoff.main(["run", "--model", str(tiny_model), *TINY, "--text-features", str(tmp_path / "features"),
                        "--out", str(tmp_path / "out")])


def _layout(path: Path) -> dict[str, tuple]:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}



def test_a_failing_method_is_recorded_and_the_run_goes_on(tiny_model, minilm, tmp_path, monkeypatch):
    feats, out = tmp_path / "features", tmp_path / "out"
    cfg = rl_payoff.PayoffConfig(model=str(tiny_model), train_two=3, train_one=1, eval_two=2, eval_one=1)
    write_prompt_features(rl_payoff.payoff_prompts(cfg).all_prompts(""), minilm, feats)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(rl_payoff, "train_method", broken)
    assert rl_payoff.main(["run", "--model", str(tiny_model), *TINY, "--methods", "nft", "--text-features", str(feats),
                           "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["methods"]["nft"]["error"] == "RuntimeError: out of memory (simulated)"
    assert result["before"]["two_objects"]["clips"] == 2 and (out / "contact_sheet.png").is_file()


def test_sync_loop_stops_before_an_iteration_that_would_pass_max_seconds():
    from omniloop.train.rl import PromptList, RolloutContext
    from omniloop.train.rl.loop import LoopConfig, async_loop, sync_loop
    from omniloop.train.rl.rewards import WeightedReward

    class Constant:
        name = "constant"

        def score(self, trajectories):
            return [1.0] * len(trajectories)

    def rollout(ctx):
        time.sleep(0.02)
        return []

    ctx = RolloutContext(client=None, prompts=PromptList(["a red circle"]), group_size=2)  # type: ignore[arg-type]
    reward = WeightedReward([(Constant(), 1.0)])
    t0 = time.monotonic()
    logs = sync_loop(rollout, ctx, reward, lambda batch: {}, LoopConfig(iterations=1000, max_seconds=0.5))
    elapsed, longest = time.monotonic() - t0, max(log.metrics["iteration_s"] for log in logs)
    assert 2 <= len(logs) < 1000  # stopped by the clock, not by the iteration count
    assert elapsed <= 0.5 + longest + 0.05  # no iteration started that was not expected to end in time
    with pytest.raises(ValueError, match="max_seconds is honoured by sync_loop only"):
        async_loop(rollout, ctx, reward, lambda batch: {}, LoopConfig(iterations=2, max_seconds=1.0))
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        LoopConfig(iterations=2, max_seconds=0)


# --------------------------------------------------------------------------------------
# validation: the best checkpoint, early stop, the refusal to ship what did not improve
# --------------------------------------------------------------------------------------

VAL = ["--val-two", "2", "--val-one", "1", "--val-seeds", "2", "--val-every", "1", "--val-patience", "2",
       "--val-margin", "0"]


def test_validation_prompts_are_train_split_and_disjoint():
    cfg = rl_payoff.PayoffConfig(train_two=12, train_one=4, eval_two=16, eval_one=8, val_two=6, val_one=3, val_seeds=2)
    sets = rl_payoff.payoff_prompts(cfg)
    prompts = [i.prompt for i in sets.val]
    assert len(sets.val) == 18 and len(set(prompts)) == 9 and len({i.seed for i in sets.val}) == 18
    assert not set(prompts) & (set(sets.train) | {i.prompt for i in sets.eval_two + sets.eval_one})
    assert all(rl_payoff._fully_stated(p, 2) for p in prompts[:12]) and all(rl_payoff._fully_stated(p, 1) for p in prompts[12:])
    assert set(prompts) <= set(sets.all_prompts())  # cache-text stores their features
    assert rl_payoff.payoff_prompts(dataclasses.replace(cfg, val_every=0)).val == []


def test_validation_keeps_the_best_checkpoint_and_stops_a_falling_run(tiny_model, minilm, tmp_path, monkeypatch):
    """Training raises the final latents' mean while validation scores its negation: validation falls
    from the first check, each method stops after ``val_patience`` checks below the initial model, its
    exported weights are the initial ones, ``improved`` is false and materialize refuses them. FlowGRPO
    runs the recipe's CUDA path (``--old-logprobs recompute``, two minibatches a batch)."""
    feats, out = tmp_path / "features", tmp_path / "out"
    cfg = rl_payoff.PayoffConfig(model=str(tiny_model), train_two=3, train_one=1, eval_two=2, eval_one=1, val_two=2,
                                 val_one=1, val_every=1)
    sets = rl_payoff.payoff_prompts(cfg)
    write_prompt_features(sets.all_prompts(""), minilm, feats)
    val_seeds = {i.seed for i in sets.val}

    class NegatedOnValidation:
        name = "latent_mean"

        def score(self, trajectories):
            return [(-1.0 if t.seed in val_seeds else 1.0) * float(t.final_latents.mean()) for t in trajectories]

    monkeypatch.setattr(rl_payoff, "adherence_reward", lambda *a, **k: WeightedReward([(NegatedOnValidation(), 1.0)]))
    assert rl_payoff.main(["run", "--model", str(tiny_model), *TINY, *VAL, "--iterations", "6", "--lr", "5e-3",
                           "--old-logprobs", "recompute", "--text-features", str(feats), "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    shipped = tiny_model / rl_payoff.TRANSFORMER_FILE
    for method in rl_payoff.METHODS:
        m = result["methods"][method]
        v = m["validation"]
        curve = [c["reward"] for c in v["curve"]]
        print(method, curve, [r.get("reward_mean") for r in m["log"]])
        assert [c["iteration"] for c in v["curve"]] == [0, 1, 2] and m["iterations"] == 2  # of 6: stopped early
        assert v["stopped_early"] and curve[1] < curve[0] and curve[2] < curve[0]
        assert m["updates"] >= 1  # it did train: the weights it ends with are not the exported ones
        if method == "flow_grpo":  # the GPU's path: old log-probs recomputed before each batch's first update
            trained = [r for r in m["log"] if "clip_frac" in r]
            assert m["old_logprobs"] == "recompute" and trained and all(r["clip_frac_first"] == 0.0 for r in trained)
            assert all(r["logprob_diff_max"] <= 1e-5 for r in trained)
        assert m["improved"] is False and v["best_iteration"] == 0 and v["best_reward"] == v["initial_reward"] == curve[0]
        weights = out / f"{method}.safetensors"
        assert file_record(weights) == file_record(shipped)  # the initial weights, exported exactly as shipped
        prov = json.loads((out / "provenance.json").read_text())[method]
        assert prov["improved"] is False and prov["best_iteration"] == 0
        with pytest.raises(ValueError, match="refusing weights that did not improve"):
            rl_payoff.main(["materialize", "--weights", str(weights), "--to", str(tmp_path / "m"), "--model",
                            str(tiny_model), "--provenance", str(out / "provenance.json"), "--method", method])
        with pytest.raises(ValueError, match="result.json says improved: true"):  # found beside the weights
            rl_payoff.materialize(weights, tmp_path / "m", model=str(tiny_model))
    assert not (tmp_path / "m").exists()


def test_best_checkpoint_keeps_the_best_weights_and_stops_after_patience():
    """Scripted checks through sync_loop: the best (iteration 1) is kept while later ones fall; a check
    back within the margin resets the count; two checks below it stop the loop."""
    from omniloop.train.rl import PromptList, RolloutContext
    from omniloop.train.rl.loop import LoopConfig, sync_loop

    class Constant:
        name = "constant"

        def score(self, trajectories):
            return [1.0] * len(trajectories)

    model = torch.nn.Linear(2, 2)
    rewards = iter([1.0, 1.5, 1.2, 1.45, 1.3, 1.0, 9.9])

    def validate():
        return {"reward": next(rewards)}

    def update_nothing(batch):
        return {}

    best = rl_payoff.BestCheckpoint(validate, model, every=1, patience=2, margin=0.1)
    best.check(0)

    def rollout(ctx):  # each batch moves the weights to its index
        with torch.no_grad():
            model.weight.fill_(float(ctx.iteration + 1))
        return []

    ctx = RolloutContext(client=None, prompts=PromptList(["a red circle"]), group_size=2)  # type: ignore[arg-type]
    logs = sync_loop(rollout, ctx, WeightedReward([(Constant(), 1.0)]), update_nothing, LoopConfig(iterations=20),
                     after_iteration=best.after_iteration)
    assert len(logs) == 5 and best.stopped_early  # checks after 1..5 batches: 1.5 best, 1.2 (below), 1.45, 1.3, 1.0
    assert [c["iteration"] for c in best.curve] == [0, 1, 2, 3, 4, 5]
    best.restore_best()
    assert torch.equal(model.weight, torch.full((2, 2), 1.0))  # the weights of the check after batch 1
    s = best.summary()
    assert s["improved"] and s["best_iteration"] == 1 and s["best_reward"] == 1.5 and s["initial_reward"] == 1.0
    # the budget: the loop gets what is left after the checks so far, with the longest check reserved once more
    assert rl_payoff.loop_seconds(60.0, 5.0, 4.0) == 50.0 and rl_payoff.loop_seconds(10.0, 9.0, 4.0) == 1e-3


def test_minibatches_are_prepared_before_the_first_update():
    calls: list[str] = []

    def prepare(mb):
        calls.append(f"prepare {len(mb)}")
        return mb

    def update(mb):
        calls.append(f"update {len(mb)}")
        return {"loss": 0.0}

    from omniloop.train.rl.buffer import TrainingBatch

    trajs = [Trajectory(request=OmniRequest(task="t2v", inputs=[TextPart(text="a")]), prompt="a", group=0)
             for _ in range(4)]
    out = rl_payoff.Minibatched(update, 2, torch.Generator().manual_seed(0), prepare)(TrainingBatch(trajs, torch.zeros(4)))
    assert calls == ["prepare 2", "prepare 2", "update 2", "update 2"] and out["updates"] == 2.0


def test_grpo_old_logprobs_follow_the_device():
    assert rl_payoff.grpo_old_logprobs(rl_payoff.PayoffConfig(device="cpu")) == "rollout"
    assert rl_payoff.grpo_old_logprobs(rl_payoff.PayoffConfig(device="cuda")) == "recompute"
    assert rl_payoff.grpo_old_logprobs(rl_payoff.PayoffConfig(device="cpu", old_logprobs="recompute")) == "recompute"
    with pytest.raises(ValueError, match="old_logprobs 'trainer'"):
        rl_payoff.PayoffConfig(old_logprobs="trainer")
    with pytest.raises(ValueError, match="val_every must be >= 0"):
        rl_payoff.PayoffConfig(val_patience=0)
