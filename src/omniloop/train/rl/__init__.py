"""RL on the serving loops (design §8.7): a consumer of the engine, never imported by it.

``RolloutFn`` / ``RolloutContext`` (rollout.py) drive an engine client (client.py: library,
in-process async or HTTP) into ``Trajectory`` s (trajectory.py); the reward layer (rewards.py)
scores them; ``TrajectoryBuffer`` (buffer.py) groups, filters and batches them with group-relative
advantages (advantages.py); objectives (objectives/: FlowGRPO, DiffusionNFT, Diffusion-DPO) train a
``VelocityModel`` (policy.py), ARGRPO a token model (over ``TokenRolloutSpec`` rollouts); the consistency ladder (consistency.py) pins the rollout to the
trainer; loop.py orders it all, sync or async.
"""

from omniloop.train.rl.buffer import TrainingBatch, TrajectoryBuffer
from omniloop.train.rl.client import AsyncEngineClient, EngineClient, HttpClient, LibraryClient
from omniloop.train.rl.consistency import ConsistencyLevel, RolloutProfile, apply_profile
from omniloop.train.rl.rewards import AdherenceScorer, HttpScorer, WeightedReward, adherence_reward
from omniloop.train.rl.rollout import (PromptList, RolloutContext, RolloutFn, RolloutSpec, TokenRolloutSpec,
                                      group_rollout)
from omniloop.train.rl.trajectory import Rewards, Trajectory, TrajectoryStatus

__all__ = [
    "AdherenceScorer", "AsyncEngineClient", "ConsistencyLevel", "EngineClient", "HttpClient", "HttpScorer",
    "LibraryClient", "PromptList", "Rewards", "RolloutContext", "RolloutFn", "RolloutProfile", "RolloutSpec",
    "TokenRolloutSpec", "TrainingBatch", "Trajectory", "TrajectoryBuffer", "TrajectoryStatus", "WeightedReward", "adherence_reward",
    "apply_profile", "group_rollout",
]
