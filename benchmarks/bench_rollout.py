"""Teacher-rollout throughput through ``run_requests`` (the trajectory stage's path): the real
shapes pipeline at the shipped latent size (16 x 5 x 16 x 16, 32 UniPC steps, CFG batched,
latents only) around a 1-layer width-64 DiT, so what is timed is mostly the engine's own
work. Prints one JSON line: wall seconds, batched denoise steps and their mean size.

    python benchmarks/bench_rollout.py 256 64                     # 256 rollouts, batches of 64
    PYTHONPATH=<other checkout>/src python benchmarks/bench_rollout.py 256 64   # A/B a commit
"""
import dataclasses, json, sys, time
import torch
from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.models.families.wan.model import WanDiT
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.train.recipes.shapes_dit import DiTRecipe
from omniloop.train.recipes.shapes_vae import VAERecipe
from omniloop.train.recipes.shapes_distill import teacher_sigmas, training_prompts
from omniloop.train.recipes.rollout import build_pipeline, run_requests, t2v_request
torch.set_num_threads(1)
cpu = torch.device("cpu")
dit_r = DiTRecipe.full(); m = dit_r.model
cfg = dataclasses.replace(dit_r.dit_config, num_layers=1, num_attention_heads=1, attention_head_dim=64, ffn_dim=64)
enc = load_minilm_encoder(device=cpu, max_sequence_length=m.max_sequence_length)
torch.manual_seed(0)
pipe = build_pipeline(m.teacher_manifest(), transformer=WanDiT(cfg).eval(), vae=WanVAE(VAERecipe.full().vae_config).eval(),
                      text_encoder=enc, device=cpu, dtype=torch.float32)
grid = teacher_sigmas(m.student_sigmas, 8)
n, batch = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 32)
reqs = [t2v_request(p, seed=i, trajectory=True, decode=False, sigmas=grid, guidance_scale=m.guidance_scale)
        for i, p in enumerate(training_prompts(0, n, 11, 0.3))]
calls, sizes = [0], []
orig = DenoiseLoop.step_many
def counted(self, ctx, loops):
    calls[0] += 1; sizes.append(len(loops)); return orig(self, ctx, loops)
DenoiseLoop.step_many = counted
t0 = time.perf_counter()
outs = run_requests(pipe, reqs, max_batch=batch)
dt = time.perf_counter() - t0
final = torch.cat([o.artifacts["trajectory"].tensor[-1] for o in outs])
print(json.dumps({"bench": "rollout_engine_cpu", "requests": n, "steps": len(grid), "max_batch": batch,
                  "seconds": round(dt, 2), "batched_steps": calls[0], "mean_batch": round(sum(sizes) / len(sizes), 1),
                  "final_checksum": float(final.double().abs().sum())}))
