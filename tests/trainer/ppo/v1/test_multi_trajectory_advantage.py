"""Per-session GRPO advantages of multi-trajectory agent-loop batches against hand-computed values."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.v1.utils import compute_advantage, compute_advantage_for_multi_trajectories


def _batch():
    # rows: p session 0 (outputs 0 and 1), p session 1, q session 0 (outputs 1 and 0, out of order), q session 1
    scores = [100.0, 1.0, 0.0, 3.0, -7.0, 1.0]
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 0]],
        dtype=torch.float32,
    )
    rewards = torch.zeros(6, 3)
    for row, score in enumerate(scores):
        rewards[row, int(mask[row].nonzero().max())] = score
    uids = np.array(["p", "p", "p", "q", "q", "q"], dtype=object)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uids}
    )
    return data, ["p_0_0", "p_0_1", "p_1_0", "q_0_1", "q_0_0", "q_1_0"]


def test_grpo_uses_each_sessions_final_output_and_broadcasts_it():
    data, keys = _batch()
    out = compute_advantage_for_multi_trajectories(data, keys, "grpo", norm_adv_by_std_in_grpo=False)
    # finals: p -> rows 1 (1.0) and 2 (0.0), mean 0.5; q -> rows 3 (3.0) and 5 (1.0), mean 2.0
    per_row = torch.tensor([0.5, 0.5, -0.5, 1.0, 1.0, -1.0])
    want = per_row.unsqueeze(-1) * data.batch["response_mask"]
    torch.testing.assert_close(out.batch["advantages"], want)
    torch.testing.assert_close(out.batch["returns"], want)


def test_other_estimators_see_the_whole_batch():
    data, keys = _batch()
    out = compute_advantage_for_multi_trajectories(data, keys, "reinforce_plus_plus", gamma=1.0)
    want = compute_advantage(_batch()[0], "reinforce_plus_plus", gamma=1.0)
    torch.testing.assert_close(out.batch["advantages"], want.batch["advantages"])


@pytest.mark.parametrize("bad", ["p0", "p_0_x"])
def test_malformed_key_is_refused(bad):
    data, keys = _batch()
    with pytest.raises(ValueError, match=bad):
        compute_advantage_for_multi_trajectories(data, [bad, *keys[1:]], "grpo")
