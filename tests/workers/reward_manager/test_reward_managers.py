"""Reward managers on hand-built DataProtos: where scores land, extra info, errors, DAPO's penalty, PRIME."""

import json
import math
import time

import pytest
import torch

from verl.trainer.ppo.reward import CustomRewardFunction
from verl.utils.reward_score.rlla import FLAG_NAMES
from verl.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardFunctionError,
    get_reward_manager_cls,
    register_reward_manager,
)

THINK = "<think> weather </think>\n"
CALL = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}
TIME_CALL = {"name": "get_time", "parameters": {"tz": "CET"}}


def _calls(*items):
    return "<tool_call>\n" + "\n".join(json.dumps(item) for item in items) + "\n</tool_call>"


LABEL = THINK + _calls(CALL, TIME_CALL)
WRONG_VALUE = THINK + _calls({"name": "get_weather", "parameters": {"city": "Paris", "unit": "F"}}, TIME_CALL)


@pytest.fixture(autouse=True)
def _no_rlla_flags(monkeypatch):
    for name in FLAG_NAMES:
        monkeypatch.delenv(name, raising=False)


def _expected(shape, cells):
    """A zero tensor with {(row, col): value} filled in."""
    tensor = torch.zeros(shape)
    for (row, col), value in cells.items():
        tensor[row, col] = value
    return tensor


# ------------------------------------------------------------------------------------------ naive
@pytest.mark.parametrize("with_response_mask", [True, False])
def test_naive_gsm8k_scores_at_the_last_valid_token(char_tokenizer, make_batch, with_response_mask):
    responses = ["so #### 18", "#### 7", "no answer"]
    data = make_batch(responses, ["18", "8", "3"], ["openai/gsm8k"] * 3, with_response_mask=with_response_mask)
    manager = NaiveRewardManager(char_tokenizer, num_examine=0)
    tensor = manager(data)
    # each response is text + <eos>: the last valid token is the <eos> at index len(text)
    assert torch.equal(tensor, _expected((3, 13), {(0, 10): 1.0, (1, 6): 0.0, (2, 9): 0.0}))
    result = manager(data, return_dict=True)
    assert torch.equal(result["reward_tensor"], tensor) and result["reward_extra_info"] == {}


def test_naive_rlla_extra_info_and_step_from_meta_info(char_tokenizer, make_batch):
    data = make_batch([LABEL, WRONG_VALUE], [LABEL, LABEL], ["rlla", "rlla"], meta_info={"global_steps": 75})
    manager = NaiveRewardManager(char_tokenizer, num_examine=0, schedulereward=True)
    result = manager(data, return_dict=True)
    # step 75 with SCHEDULEREWARD: format max 1.5, correctness in [-2.5, 2.5];
    # wrong value: S = 5 of 6 -> 5 * 5/6 - 2.5 = 5/3
    extra = result["reward_extra_info"]
    assert extra["format"] == [1.5, 1.5]
    assert extra["correctness"] == pytest.approx([2.5, 5 / 3])
    assert extra["length"] == [0, 0]
    assert extra["score"] == pytest.approx([4.0, 1.5 + 5 / 3])
    scores = result["reward_tensor"].sum(-1)
    assert scores.tolist() == pytest.approx([4.0, 1.5 + 5 / 3])
    assert result["reward_tensor"][0, len(LABEL)] == pytest.approx(4.0)
    # without global_steps rlla gets step 0: format max 2, correctness max 2
    data.meta_info.pop("global_steps")
    assert manager(data, return_dict=True)["reward_extra_info"]["score"][0] == pytest.approx(4.0)
    assert manager(data, return_dict=True)["reward_extra_info"]["format"][0] == 2.0


def test_step_is_only_passed_to_functions_that_take_it(char_tokenizer, make_batch):
    seen = []

    def no_step(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 1.0

    def with_step(data_source, solution_str, ground_truth, extra_info=None, step=None):
        seen.append(step)
        return 1.0

    data = make_batch(["a"], ["a"], ["x"], extra_infos=[{"k": 1}], meta_info={"global_steps": 9})
    NaiveRewardManager(char_tokenizer, 0, compute_score=no_step)(data)
    NaiveRewardManager(char_tokenizer, 0, compute_score=with_step)(data)
    assert seen == [{"k": 1}, 9]


def test_num_examine_prints_per_data_source(char_tokenizer, make_batch, capsys):
    data = make_batch(["#### 1", "#### 2", "#### 3"], ["1", "2", "3"], ["openai/gsm8k"] * 3)
    NaiveRewardManager(char_tokenizer, num_examine=2)(data)
    out = capsys.readouterr().out
    assert out.count("[openai/gsm8k] response:") == 2 and "'#### 2'" in out and "'#### 3'" not in out


def test_rm_scores_pass_through(char_tokenizer, make_batch):
    data = make_batch(["a"], ["a"], ["x"])
    data.batch["rm_scores"] = torch.full(data.batch["responses"].shape, 0.5)
    assert torch.equal(NaiveRewardManager(char_tokenizer, 0)(data), data.batch["rm_scores"])


# ------------------------------------------------------------------------------------------ errors
def _raising(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "bad":
        raise KeyError("missing field")
    return 1.0


def test_exception_names_data_source_and_index_or_scores_zero(char_tokenizer, make_batch):
    data = make_batch(["ok", "bad", "ok"], ["", "", ""], ["a", "b", "c"], index=[10, 11, 12])
    with pytest.raises(RewardFunctionError, match=r"row 1 \(data_source='b', index=11\).*KeyError.*missing field"):
        NaiveRewardManager(char_tokenizer, 0, compute_score=_raising)(data)
    result = NaiveRewardManager(char_tokenizer, 0, compute_score=_raising, on_error="zero")(data, return_dict=True)
    assert result["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0]
    assert result["reward_extra_info"]["reward_errors"] == [0, 1, 0]
    with pytest.raises(ValueError, match="on_error='skip'; allowed"):
        NaiveRewardManager(char_tokenizer, 0, on_error="skip")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "returned a non-finite score nan"),
        ("1.0", "returned score '1.0' of type str"),
        ((1.0, 2.0), "returned a tuple of length 2: \\(1.0, 2.0\\)"),
        ({"acc": 1.0}, "returned a dict without 'score' \\(keys \\['acc'\\]\\)"),
        (None, "returned score None"),
    ],
)
def test_bad_return_values_are_named(char_tokenizer, make_batch, value, message):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return value if solution_str == "bad" else 1.0

    data = make_batch(["ok", "bad"], ["", ""], ["a", "b"])
    with pytest.raises(RewardFunctionError, match=rf"row 1 \(data_source='b'\): {message}"):
        NaiveRewardManager(char_tokenizer, 0, compute_score=scorer)(data)
    zero = NaiveRewardManager(char_tokenizer, 0, compute_score=scorer, on_error="zero")(data, return_dict=True)
    assert zero["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]
    assert zero["reward_extra_info"]["reward_errors"] == [0, 1]


def test_accepted_return_shapes(char_tokenizer, make_batch):
    results = {"t": (2.0, 1.0, 1.0, 0), "n": torch.tensor(0.5), "b": True}

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return results[solution_str]

    data = make_batch(["t", "n", "b"], ["", "", ""], ["x"] * 3)
    out = NaiveRewardManager(char_tokenizer, 0, compute_score=scorer)(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [2.0, 0.5, 1.0]
    # keys missing in some samples are filled with None
    assert out["reward_extra_info"] == {
        "score": [2.0, None, None],
        "format": [1.0, None, None],
        "correctness": [1.0, None, None],
        "length": [0, None, None],
    }


# ------------------------------------------------------------------------------------------ batch
def test_batch_manager_calls_once_with_lists(char_tokenizer, make_batch):
    calls = []

    def batched(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        calls.append((list(data_sources), list(solution_strs), list(ground_truths), list(extra_infos)))
        return [{"score": scale * float(s == g), "acc": s == g} for s, g in zip(solution_strs, ground_truths)]

    data = make_batch(["a", "b", "c"], ["a", "x", "c"], ["d1", "d2", "d1"])
    out = BatchRewardManager(char_tokenizer, 0, compute_score=batched, scale=2.0)(data, return_dict=True)
    assert calls == [(["d1", "d2", "d1"], ["a", "b", "c"], ["a", "x", "c"], [{"i": 0}, {"i": 1}, {"i": 2}])]
    assert out["reward_tensor"].sum(-1).tolist() == [2.0, 0.0, 2.0]
    assert out["reward_extra_info"]["acc"] == [True, False, True]


def test_batch_manager_errors_and_default(char_tokenizer, make_batch):
    data = make_batch(["#### 4", "#### 5"], ["4", "4"], ["openai/gsm8k", "openai/gsm8k"])
    assert BatchRewardManager(char_tokenizer, 0)(data).sum(-1).tolist() == [1.0, 0.0]

    def short(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    with pytest.raises(
        RewardFunctionError,
        match=r"short on a batch of 2 samples \(data sources \['openai/gsm8k'\]\): returned list of length 1; ",
    ):
        BatchRewardManager(char_tokenizer, 0, compute_score=short)(data)

    def broken(data_sources, solution_strs, ground_truths, extra_infos):
        raise RuntimeError("judge down")

    with pytest.raises(
        RewardFunctionError,
        match=r"broken on a batch of 2 samples \(data sources \['openai/gsm8k'\]\): RuntimeError: judge down",
    ):
        BatchRewardManager(char_tokenizer, 0, compute_score=broken)(data)
    zero = BatchRewardManager(char_tokenizer, 0, compute_score=broken, on_error="zero")(data, return_dict=True)
    assert zero["reward_extra_info"]["reward_errors"] == [1, 1]


# ------------------------------------------------------------------------------------------ dapo
def test_dapo_overlong_buffer_penalty(char_tokenizer, make_batch):
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 1.0

    # valid lengths (text + <eos>) 5, 8, 10; max_resp_len 10, buffer 4 -> expected length 6:
    # exceed -1 -> min(0.25, 0) = 0; exceed 2 -> -2/4 = -0.5; exceed 4 -> -1.0
    data = make_batch(["abcd", "abcdefg", "abcdefghi"], ["", "", ""], ["x"] * 3, response_len=10)
    cfg = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    manager = DAPORewardManager(char_tokenizer, 0, compute_score=scorer, max_resp_len=10, overlong_buffer_cfg=cfg)
    out = manager(data, return_dict=True)
    assert torch.equal(out["reward_tensor"], _expected((3, 10), {(0, 4): 1.0, (1, 7): 0.5, (2, 9): 0.0}))
    assert out["reward_extra_info"]["overlong_reward"] == [0.0, -0.5, -1.0]
    assert out["reward_extra_info"]["overlong"] == [False, True, True]
    assert seen == ["abcd", "abcdefg", "abcdefghi"]
    # factor 0.5 halves the penalty; disabled -> plain scores
    cfg_half = dict(cfg, penalty_factor=0.5, log=False)
    half = DAPORewardManager(char_tokenizer, 0, compute_score=scorer, max_resp_len=10, overlong_buffer_cfg=cfg_half)
    assert half(data).sum(-1).tolist() == [1.0, 0.75, 0.5]
    off = DAPORewardManager(char_tokenizer, 0, compute_score=scorer, overlong_buffer_cfg={"enable": False})
    assert off(data).sum(-1).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="max_resp_len=None"):
        DAPORewardManager(char_tokenizer, 0, overlong_buffer_cfg=cfg)


# ------------------------------------------------------------------------------------------ prime
PRIME_SCORER = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, delay=0.0):
    if solution_str == "hang":
        time.sleep(120)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "raise":
        raise ValueError("no way")
    time.sleep(delay)
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
"""


@pytest.fixture
def prime_scorer(tmp_path):
    path = tmp_path / "prime_scorer.py"
    path.write_text(PRIME_SCORER)
    return str(path)


@pytest.mark.serial  # asserts wall time or CPU share: run alone (scripts/run_tests.sh)
def test_prime_parallel_timeout_and_dead_process(char_tokenizer, make_batch, prime_scorer):
    # a delay long against the processes' start (~2.5 s for four on a slow 2-core machine), so that side by side
    # (delay + start) and one after another (4 x delay) are far apart
    fn = CustomRewardFunction(prime_scorer, "compute_score", {"delay": 2.0})
    data = make_batch(["a", "b", "x", "y"], ["a", "b", "x", "q"], ["s"] * 4)
    manager = PrimeRewardManager(char_tokenizer, 0, compute_score=fn, num_processes=4, timeout_s=30)
    start = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - start < 4 * 2.0  # four 2 s samples side by side, not one after another
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert len(set(out["reward_extra_info"]["pid"])) == 4  # one process per sample

    bad = make_batch(["a", "hang", "die", "raise"], ["a", "", "", ""], ["s", "t", "u", "v"])
    quick = CustomRewardFunction(prime_scorer, "compute_score")
    manager = PrimeRewardManager(
        char_tokenizer, 0, compute_score=quick, num_processes=2, timeout_s=1.5, on_error="zero"
    )
    start = time.monotonic()
    out = manager(bad, return_dict=True)
    assert time.monotonic() - start < 10
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out["reward_extra_info"]["reward_errors"] == [0, 1, 1, 1]
    strict = PrimeRewardManager(char_tokenizer, 0, compute_score=quick, num_processes=2, timeout_s=1.5)
    with pytest.raises(RewardFunctionError, match=r"row 1 \(data_source='t'\): TimeoutError"):
        strict(bad)
    with pytest.raises(RewardFunctionError, match=r"row 0 \(data_source='u'\): scoring process died with exit code 3"):
        strict(bad[2:3])
    with pytest.raises(RewardFunctionError, match=r"ValueError: no way"):
        strict(bad[3:4])


def test_prime_forkserver_default_scorer_sees_current_env(char_tokenizer, make_batch, monkeypatch):
    data = make_batch([LABEL, WRONG_VALUE], [LABEL, LABEL], ["rlla", "rlla"])
    manager = PrimeRewardManager(char_tokenizer, 0, num_processes=2, timeout_s=120)
    assert manager(data, return_dict=True)["reward_extra_info"]["correctness"] == pytest.approx([3.0, 2.0])
    monkeypatch.setenv("COARSEREWARD", "1")  # set after the forkserver started: still seen by the scorer
    assert manager(data, return_dict=True)["reward_extra_info"]["correctness"] == [3.0, -3.0]
    with pytest.raises(ValueError, match="picklable compute_score"):
        PrimeRewardManager(char_tokenizer, 0, compute_score=lambda **kw: 1.0)


# ------------------------------------------------------------------------------------------ registry
def test_registry():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("batch") is BatchRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("prime") is PrimeRewardManager
    with pytest.raises(ValueError, match=r"unknown reward manager 'nope'; registered: \[.*'batch'.*'naive'"):
        get_reward_manager_cls("nope")

    @register_reward_manager("test_double")
    class Double(NaiveRewardManager):
        def final_rewards(self, samples, scores, extra):
            return [2 * s for s in scores]

    assert get_reward_manager_cls("test_double") is Double
    with pytest.raises(ValueError, match="already registered"):
        register_reward_manager("test_double")(NaiveRewardManager)
