"""verl/trainer/ppo/reward.py: custom reward functions from a file, managers from config, compute_reward.

(Kept next to the reward-manager tests, which own the tokenizer and batch fixtures it uses.)
"""

import inspect
import pickle

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo.reward import CustomRewardFunction, compute_reward, get_custom_reward_fn, load_reward_manager
from verl.workers.reward_manager import DAPORewardManager, NaiveRewardManager, PrimeRewardManager

CUSTOM = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "len": len(solution_str)}

def with_step(data_source, solution_str, ground_truth, extra_info=None, step=0):
    return float(step)

VALUE = 3
"""


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def _config(**overrides):
    base = {
        "data": {"reward_fn_key": "data_source"},
        "reward_model": {"reward_manager": "naive", "on_error": "raise", "reward_kwargs": {}},
        "custom_reward_function": {"path": None, "name": "compute_score"},
    }
    config = OmegaConf.create(base)
    return OmegaConf.merge(config, OmegaConf.create(overrides))


def test_get_custom_reward_fn_loads_and_binds_kwargs(custom_file):
    assert get_custom_reward_fn(_config()) is None
    config = _config(custom_reward_function={"path": custom_file, "reward_kwargs": {"bonus": 0.5}})
    fn = get_custom_reward_fn(config)
    assert fn("d", "a", "a") == {"score": 1.5, "len": 1}
    assert isinstance(fn, CustomRewardFunction) and "bonus" not in inspect.signature(fn).parameters
    clone = pickle.loads(pickle.dumps(fn))  # re-imports the file: usable in worker processes
    assert clone("d", "a", "b") == {"score": 0.5, "len": 1}


def test_get_custom_reward_fn_errors_name_path_and_name(custom_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path='/no/such.py'"):
        get_custom_reward_fn(_config(custom_reward_function={"path": "/no/such.py"}))
    with pytest.raises(
        AttributeError,
        match=r"name='score_it' is not defined in .*my_reward.py; functions there: "
        r"\['compute_score', 'with_step'\]",
    ):
        get_custom_reward_fn(_config(custom_reward_function={"path": custom_file, "name": "score_it"}))
    with pytest.raises(TypeError, match="'VALUE' in .* is a int, not a function"):
        get_custom_reward_fn(_config(custom_reward_function={"path": custom_file, "name": "VALUE"}))
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match=r"path='.*broken.py' failed to import: SyntaxError"):
        get_custom_reward_fn(_config(custom_reward_function={"path": str(broken)}))
    failing = tmp_path / "failing.py"
    failing.write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match="failed to import: ModuleNotFoundError"):
        get_custom_reward_fn(_config(custom_reward_function={"path": str(failing)}))


def test_load_reward_manager_from_config(char_tokenizer, make_batch, custom_file):
    manager = load_reward_manager(_config(), char_tokenizer, num_examine=0)
    assert isinstance(manager, NaiveRewardManager) and manager.on_error == "raise"
    data = make_batch(["#### 3", "#### 4"], ["3", "3"], ["openai/gsm8k"] * 2)
    tensor, extra = compute_reward(data, manager)
    assert tensor.sum(-1).tolist() == [1.0, 0.0] and extra == {}

    config = _config(
        reward_model={
            "reward_manager": "dapo",
            "on_error": "zero",
            "reward_kwargs": {
                "max_resp_len": 8,
                "overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0},
            },
        },
        custom_reward_function={"path": custom_file},
    )
    manager = load_reward_manager(config, char_tokenizer, num_examine=0)
    assert isinstance(manager, DAPORewardManager) and manager.on_error == "zero"
    data = make_batch(["abc", "abcdef"], ["abc", "x"], ["d", "d"], response_len=8)
    tensor, extra = compute_reward(data, manager)
    # valid lengths 4 and 7, expected length 8 - 4 = 4: penalties 0 and -3/4
    assert tensor.sum(-1).tolist() == [1.0, -0.75]
    assert extra["len"] == [3, 6] and extra["reward_errors"] == [0, 0]


def test_load_reward_manager_kwargs_and_unknown_name(char_tokenizer, make_batch, custom_file):
    config = _config(
        reward_model={"reward_manager": "prime", "reward_kwargs": {"timeout_s": 30}},
        custom_reward_function={"path": custom_file, "name": "with_step"},
    )
    manager = load_reward_manager(config, char_tokenizer, num_examine=0, num_processes=2)
    assert isinstance(manager, PrimeRewardManager) and manager.timeout_s == 30 and manager.num_processes == 2
    data = make_batch(["a", "b"], ["a", "b"], ["d", "d"], meta_info={"global_steps": 7})
    tensor, _ = compute_reward(data, manager)
    assert tensor.sum(-1).tolist() == [7.0, 7.0]  # step reaches a custom function that takes it
    with pytest.raises(ValueError, match="unknown reward manager 'fancy'; registered"):
        load_reward_manager(_config(reward_model={"reward_manager": "fancy"}), char_tokenizer, 0)


def test_rlla_flags_from_reward_kwargs(char_tokenizer, make_batch):
    label = '<think> t </think>\n<tool_call>\n{"name": "f", "parameters": {}}\n</tool_call>'
    config = _config(reward_model={"reward_kwargs": {"withlength": True}})
    manager = load_reward_manager(config, char_tokenizer, num_examine=0)
    think = "<think> " + " ".join(["w"] * 256) + " </think>\n" + label.split("</think>\n")[1]
    _, extra = compute_reward(make_batch([think], [label], ["rlla"]), manager)
    assert extra["length"] == [0.5]  # 256 words / 512


def test_compute_reward_accepts_a_plain_tensor_function(make_batch):
    data = make_batch(["a"], ["a"], ["d"])
    tensor, extra = compute_reward(data, lambda batch, return_dict=False: torch.ones(1, 3))
    assert tensor.tolist() == [[1.0, 1.0, 1.0]] and extra == {}
