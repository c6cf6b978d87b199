"""trainer.rollout_data_dir / validation_data_dir: `<dir>/<global_step>.jsonl` with verl's fields."""

import json

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import generation_dump


class CharTokenizer:
    """ids are character codes; 0 is the (special) pad token."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(int(i)) for i in row if not (skip_special_tokens and int(i) == 0)) for row in ids]


def _ids(texts, width):
    return torch.tensor([[0] * (width - len(t)) + [ord(c) for c in t] for t in texts])


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_rollout_dump_has_verls_fields_and_reward_extras(tmp_path):
    scores = torch.zeros(2, 3)
    scores[0, 2], scores[1, 1] = 1.5, -0.5
    batch = DataProto.from_dict(
        tensors={"prompts": _ids(["hi", "yo"], 4), "responses": _ids(["abc", "d"], 3), "token_level_scores": scores},
        non_tensors={
            "reward_model": np.array([{"ground_truth": "42"}, {"style": "rule"}], dtype=object),
            "uid": np.array(["u0", "u1"], dtype=object),
            "acc": np.array([True, False], dtype=object),
            "data_source": np.array(["x", "x"], dtype=object),
        },
    )
    trainer_cfg = {"rollout_data_dir": str(tmp_path / "rollouts")}
    path = generation_dump.dump_rollout(trainer_cfg, CharTokenizer(), batch, {"acc", "not_there"}, global_steps=7)
    assert path == str(tmp_path / "rollouts" / "7.jsonl")
    assert _rows(path) == [
        {"input": "hi", "output": "abc", "gts": "42", "score": 1.5, "step": 7, "acc": True, "uid": "u0"},
        {"input": "yo", "output": "d", "gts": None, "score": -0.5, "step": 7, "acc": False, "uid": "u1"},
    ]
    assert generation_dump.dump_rollout({"rollout_data_dir": None}, CharTokenizer(), batch, set(), 7) is None


def test_validation_dump_adds_reward_column_and_skips_ragged_extras(tmp_path):
    trainer_cfg = {"validation_data_dir": str(tmp_path / "val")}
    extras = {"pred": ["1", "2"], "ragged": [1], "vec": np.array([0.5, 0.25])}
    path = generation_dump.dump_validation(trainer_cfg, ["q1", "q2"], ["a1", "a2"], ["1", "3"], [1.0, 0.0], extras, 0)
    assert _rows(path) == [
        {"input": "q1", "output": "a1", "gts": "1", "score": 1.0, "step": 0, "reward": 1.0, "pred": "1", "vec": 0.5},
        {"input": "q2", "output": "a2", "gts": "3", "score": 0.0, "step": 0, "reward": 0.0, "pred": "2", "vec": 0.25},
    ]
    generation_dump.dump_validation(trainer_cfg, ["q"], ["b"], [None], [2.0], {}, 0)  # a later dump of step 0 replaces
    assert len(_rows(path)) == 1
    assert generation_dump.dump_validation({}, ["q"], ["a"], [None], [0.0], {}, 1) is None
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl"]
