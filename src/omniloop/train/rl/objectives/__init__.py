"""Training objectives over trajectories: FlowGRPO (per-step SDE log-probs), DiffusionNFT
(likelihood-free, final latents), Diffusion-DPO (offline preference pairs of final latents) and
ARGRPO (per-token log-probs of AR rollouts). Each is a small module; advantages are
``advantages.py``'s."""

from omniloop.train.rl.objectives.ar_grpo import ARGRPOConfig, ar_grpo_iteration, ar_grpo_loss
from omniloop.train.rl.objectives.dpo import (DPOConfig, PreferencePair, PreferencePairs, dpo_loss, load_pairs,
                                              save_pairs)
from omniloop.train.rl.objectives.diffusion_nft import NFTConfig, blend_old_policy, nft_loss
from omniloop.train.rl.objectives.flow_grpo import (FlowGRPOConfig, flow_grpo_loss, step_log_probs, trainer_log_probs,
                                                    truncated_importance_weight)

__all__ = ["ARGRPOConfig", "DPOConfig", "FlowGRPOConfig", "NFTConfig", "PreferencePair", "PreferencePairs",
           "ar_grpo_iteration", "ar_grpo_loss", "blend_old_policy", "dpo_loss", "flow_grpo_loss", "load_pairs",
           "nft_loss", "save_pairs", "step_log_probs", "trainer_log_probs", "truncated_importance_weight"]
