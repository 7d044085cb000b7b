"""Training objectives over trajectories: FlowGRPO (per-step SDE log-probs), DiffusionNFT
(likelihood-free, final latents) and ARGRPO (per-token log-probs of AR rollouts). Each is a small
module; advantages are ``advantages.py``'s."""

from omniloop.train.rl.objectives.ar_grpo import ARGRPOConfig, ar_grpo_iteration, ar_grpo_loss
from omniloop.train.rl.objectives.diffusion_nft import NFTConfig, blend_old_policy, nft_loss
from omniloop.train.rl.objectives.flow_grpo import (FlowGRPOConfig, flow_grpo_loss, step_log_probs, trainer_log_probs,
                                                    truncated_importance_weight)

__all__ = ["ARGRPOConfig", "FlowGRPOConfig", "NFTConfig", "ar_grpo_iteration", "ar_grpo_loss", "blend_old_policy",
           "flow_grpo_loss", "nft_loss", "step_log_probs", "trainer_log_probs", "truncated_importance_weight"]
