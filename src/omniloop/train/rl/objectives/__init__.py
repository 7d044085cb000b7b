"""Training objectives over trajectories: FlowGRPO (per-step SDE log-probs), DiffusionNFT
(likelihood-free, final latents) and Diffusion-DPO (offline preference pairs of final latents).
Each is a small module; advantages are ``advantages.py``'s."""

from omniloop.train.rl.objectives.dpo import DPOConfig, PreferencePair, PreferencePairs, dpo_loss, load_pairs, save_pairs
from omniloop.train.rl.objectives.diffusion_nft import NFTConfig, blend_old_policy, nft_loss
from omniloop.train.rl.objectives.flow_grpo import (FlowGRPOConfig, flow_grpo_loss, step_log_probs, trainer_log_probs,
                                                    truncated_importance_weight)

__all__ = ["DPOConfig", "FlowGRPOConfig", "PreferencePair", "PreferencePairs", "dpo_loss", "load_pairs", "save_pairs",
           "NFTConfig", "blend_old_policy", "flow_grpo_loss", "nft_loss", "step_log_probs",
           "trainer_log_probs", "truncated_importance_weight"]
