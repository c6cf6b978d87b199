"""Tests for verl.trainer.ppo.advantage_variants (gdpo, optimal_token_baseline, tir_optimal_token_baseline), each
against a reference written here in plain Python from the formula; the actor's `sum_pi_squared`; a short run."""

import math
import statistics

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

import verl.utils.torch_functional as verl_F
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.advantage_variants import (
    VARIANT_ADV_ESTIMATORS,
    compute_gdpo_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from verl.trainer.ppo.core_algos import AdvantageEstimator, compute_advantage, get_adv_estimator_fn
from verl.trainer.ppo.metric_utils import compute_gdpo_metrics
from verl.workers.actor import DataParallelPPOActor

# 8 responses of length 6 in groups a (4 rows), b (3 rows) and c (1 row). Row 3 has a masked tool observation
# (tokens 2-3) inside its response; row 6 is empty. Groups a and b each have one strictly longest response.
UIDS = np.array(["a", "a", "b", "a", "b", "b", "c", "a"], dtype=object)
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ],
    dtype=torch.float32,
)
BS, T = MASK.shape


def _fields(seed: int = 0, mask: torch.Tensor = MASK):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(mask.shape, generator=gen) * mask
    old_log_probs = -torch.rand(mask.shape, generator=gen) * 3.0
    sum_pi_squared = 0.05 + 0.95 * torch.rand(mask.shape, generator=gen)
    is_weights = 0.5 + torch.rand(mask.shape, generator=gen)
    return rewards, old_log_probs, sum_pi_squared, is_weights


def _groups(uids) -> dict:
    out: dict = {}
    for i, uid in enumerate(uids):
        out.setdefault(uid, []).append(i)
    return out


def _lists(t: torch.Tensor) -> list:
    return t.tolist()


def _ref_returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights):
    """G[i][t] = sum_{j>=t} m r; W[i][t] = sum_{j<=t} m (1 - 2 exp(logp) + sum pi^2) rho^2."""
    r, m, lp, sp = _lists(rewards), _lists(mask), _lists(old_log_probs), _lists(sum_pi_squared)
    rho = _lists(is_weights) if is_weights is not None else [[1.0] * len(row) for row in m]
    G = [[sum(m[i][j] * r[i][j] for j in range(t, len(m[i]))) for t in range(len(m[i]))] for i in range(len(m))]
    W = []
    for i in range(len(m)):
        row, acc = [], 0.0
        for t in range(len(m[i])):
            acc += m[i][t] * (1 - 2 * math.exp(lp[i][t]) + sp[i][t]) * rho[i][t] ** 2
            row.append(acc)
        W.append(row)
    return G, W


def _ref_lone_longest(lengths: list[int]):
    longest = max(lengths)
    rest = sorted(lengths)[-2]
    if lengths.count(longest) == 1 and longest > rest:
        return lengths.index(longest), rest
    return None


def ref_otb(rewards, mask, uids, old_log_probs, sum_pi_squared, is_weights=None, zero_tail=True, eps=1e-8):
    m = _lists(mask)
    G, W = _ref_returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    B = [[0.0] * T for _ in m]
    for rows in _groups(uids).values():
        if len(rows) == 1:
            continue
        for t in range(T):
            num = sum(G[i][t] * W[i][t] * m[i][t] for i in rows)
            den = sum(W[i][t] * m[i][t] for i in rows) + eps
            for i in rows:
                B[i][t] = num / den
        lone = _ref_lone_longest([int(sum(m[i])) for i in rows]) if zero_tail else None
        if lone is not None:
            for t in range(lone[1], T):
                B[rows[lone[0]]][t] = 0.0
    adv = [[(G[i][t] - B[i][t]) * m[i][t] for t in range(T)] for i in range(len(m))]
    return torch.tensor(adv), torch.tensor(G)


def ref_tir_otb(rewards, mask, uids, old_log_probs, sum_pi_squared, is_weights=None, zero_tail=True, eps=1e-8):
    m = _lists(mask)
    G, W = _ref_returns_and_w(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    kept = [[t for t in range(T) if m[i][t] > 0] for i in range(len(m))]  # the policy's own tokens, in order
    adv = [[0.0] * T for _ in m]
    for rows in _groups(uids).values():
        rows = [i for i in rows if kept[i]]
        longest = max((len(kept[i]) for i in rows), default=0)
        base = {i: [0.0] * longest for i in rows}
        if len(rows) > 1:
            for k in range(longest):
                num = sum(G[i][kept[i][k]] * W[i][kept[i][k]] for i in rows if k < len(kept[i]))
                den = sum(W[i][kept[i][k]] for i in rows if k < len(kept[i])) + eps
                for i in rows:
                    base[i][k] = num / den
            lone = _ref_lone_longest([len(kept[i]) for i in rows]) if zero_tail else None
            if lone is not None:
                for k in range(lone[1], longest):
                    base[rows[lone[0]]][k] = 0.0
        for i in rows:
            for k, t in enumerate(kept[i]):
                adv[i][t] = G[i][t] - base[i][k]
    return torch.tensor(adv), torch.tensor(G)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ registry
def test_variants_are_registered_under_verls_names():
    assert AdvantageEstimator.GDPO.value == "gdpo"
    assert AdvantageEstimator.OPTIMAL_TOKEN_BASELINE.value == "optimal_token_baseline"
    assert AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE.value == "tir_optimal_token_baseline"
    for name, fn in VARIANT_ADV_ESTIMATORS.items():
        assert get_adv_estimator_fn(AdvantageEstimator(name)) is fn
        assert getattr(core_algos, fn.__name__) is fn and fn.__name__ in core_algos.__all__


# ------------------------------------------------------------------------------------ optimal token baseline
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_otb_matches_the_formula(zero_tail, with_is):
    rewards, lp, sp, rho = _fields(seed=1)
    rho = rho if with_is else None
    adv, ret = compute_optimal_token_baseline_advantage(
        rewards, MASK, UIDS, lp, sp, rollout_is_weights=rho, handle_zero_tail=zero_tail
    )
    ref_adv, ref_ret = ref_otb(rewards, MASK, UIDS, lp, sp, rho, zero_tail)
    _close(adv, ref_adv)
    _close(ret, ref_ret)
    assert (adv[MASK == 0] == 0).all()
    # the lone member of group c keeps its return; the longest of group a has no baseline past length 4
    _close(adv[6], ret[6] * MASK[6])
    if zero_tail:
        _close(adv[1, 4:], ret[1, 4:])


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_tir_otb_matches_the_formula(zero_tail, with_is):
    rewards, lp, sp, rho = _fields(seed=2)
    rho = rho if with_is else None
    adv, ret = compute_multi_turn_optimal_token_baseline_advantage(
        rewards, MASK, UIDS, lp, sp, rollout_is_weights=rho, handle_zero_tail=zero_tail
    )
    ref_adv, ref_ret = ref_tir_otb(rewards, MASK, UIDS, lp, sp, rho, zero_tail)
    _close(adv, ref_adv)
    _close(ret, ref_ret)
    assert (adv[MASK == 0] == 0).all()


def test_tir_otb_aligns_the_policys_tokens_across_a_tool_observation():
    # row 3's third generated token sits at position 4 (2-3 are an observation): the tir variant compares it with
    # the others' third tokens (position 2), the plain one with their position-4 tokens
    rewards, lp, sp, _ = _fields(seed=3)
    tir, _ = compute_multi_turn_optimal_token_baseline_advantage(rewards, MASK, UIDS, lp, sp)
    plain, _ = compute_optimal_token_baseline_advantage(rewards, MASK, UIDS, lp, sp)
    assert not torch.allclose(tir[3], plain[3])


def test_otb_variants_agree_on_right_padded_single_turn_responses():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    uids = np.array([0, 0, 0, 1, 1], dtype=object)
    rewards, lp, sp, rho = _fields(seed=4, mask=mask)
    plain = compute_optimal_token_baseline_advantage(rewards, mask, uids, lp, sp, rollout_is_weights=rho)
    tir = compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, uids, lp, sp, rollout_is_weights=rho)
    _close(plain[0], tir[0])
    _close(plain[1], tir[1])


def _otb_data(with_sum_pi_squared: bool = True, with_is: bool = False) -> DataProto:
    rewards, lp, sp, rho = _fields(seed=5)
    tensors = {"token_level_rewards": rewards, "response_mask": MASK, "old_log_probs": lp}
    if with_sum_pi_squared:
        tensors["sum_pi_squared"] = sp
    if with_is:
        tensors["rollout_is_weights"] = rho
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": UIDS})


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_is", [False, True])
def test_compute_advantage_hands_otb_the_actor_fields(name, with_is):
    data = _otb_data(with_is=with_is)
    b = data.batch
    rho = b["rollout_is_weights"] if with_is else None
    expected = VARIANT_ADV_ESTIMATORS[name](
        b["token_level_rewards"], MASK, UIDS, b["old_log_probs"], b["sum_pi_squared"], rollout_is_weights=rho
    )
    out = compute_advantage(data, name, config=OmegaConf.create({"gamma": 1.0, "lam": 1.0}))
    _close(out.batch["advantages"], expected[0])
    _close(out.batch["returns"], expected[1])


@pytest.mark.parametrize("name", ["optimal_token_baseline", AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE])
def test_otb_without_sum_pi_squared_says_which_setting_to_turn_on(name):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.calculate_sum_pi_squared=True"):
        compute_advantage(_otb_data(with_sum_pi_squared=False), name)


# ------------------------------------------------------------------------------------------------------ gdpo
GDPO_MASK = MASK[[0, 1, 2, 3, 4, 5, 7]]  # no empty response here (verl places each score at the last token)
GDPO_UIDS = UIDS[[0, 1, 2, 3, 4, 5, 7]]
FORMAT = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
ACCURACY = [3.0, 0.0, -2.0, 5.0, 1.0, 1.0, 2.0]


def ref_gdpo(components, weights, mask, uids, norm_by_std=True, eps=1e-6):
    """Per component: group-normalised score (group of one: mean 0, std 1); weighted sum; masked whitening."""
    m = _lists(mask)
    total = [0.0] * len(m)
    for scores, w in zip(components, weights):
        for rows in _groups(uids).values():
            vals = [scores[i] for i in rows]
            mean, std = (0.0, 1.0) if len(rows) == 1 else (statistics.mean(vals), statistics.stdev(vals))
            for i in rows:
                total[i] += w * ((scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean)
    tokens = [total[i] * m[i][t] for i in range(len(m)) for t in range(T) if m[i][t] > 0]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    adv = [[(total[i] * m[i][t] - mean) / math.sqrt(var + 1e-8) * m[i][t] for t in range(T)] for i in range(len(m))]
    return torch.tensor(adv)


def _gdpo_data(weights=None) -> tuple[DataProto, dict]:
    prompts = torch.ones(len(GDPO_UIDS), 3, dtype=torch.long)
    # attention covers the tool observation inside row 3's response, as a multi-turn rollout's does
    last = [max(t for t in range(T) if GDPO_MASK[i, t] > 0) for i in range(len(GDPO_UIDS))]
    response_attention = (torch.arange(T).expand(len(last), -1) <= torch.tensor(last).unsqueeze(1)).long()
    scores = [f + a for f, a in zip(FORMAT, ACCURACY)]
    rewards = torch.zeros_like(GDPO_MASK)
    rewards[torch.arange(len(last)), torch.tensor(last)] = torch.tensor(scores)
    data = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "attention_mask": torch.cat([torch.ones_like(prompts), response_attention], dim=1),
            "token_level_rewards": rewards,
            "response_mask": GDPO_MASK,
        },
        non_tensors={
            "uid": GDPO_UIDS,
            "format": np.array(FORMAT, dtype=object),
            "accuracy": np.array(ACCURACY, dtype=object),
        },
    )
    config = {"gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": weights, "gamma": 1.0}
    return data, config


@pytest.mark.parametrize("weights", [None, [0.5, 2.0]])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_gdpo_normalises_each_reward_component_in_its_group(weights, norm_by_std):
    data, config = _gdpo_data(weights)
    adv, ret = compute_gdpo_outcome_advantage(
        data.batch["token_level_rewards"],
        GDPO_MASK,
        GDPO_UIDS,
        norm_adv_by_std_in_grpo=norm_by_std,
        config=OmegaConf.create(config),
        non_tensor_batch=data.non_tensor_batch,
        batch=data.batch,
    )
    expected = ref_gdpo([FORMAT, ACCURACY], weights or [1.0, 1.0], GDPO_MASK, GDPO_UIDS, norm_by_std)
    _close(adv, expected)
    assert adv is ret
    assert (adv[GDPO_MASK == 0] == 0).all()


def test_gdpo_is_not_grpo_on_the_summed_reward():
    data, config = _gdpo_data()
    gdpo = compute_advantage(data, "gdpo", config=OmegaConf.create(config)).batch["advantages"]
    summed = [f + a for f, a in zip(FORMAT, ACCURACY)]
    _close(gdpo, ref_gdpo([FORMAT, ACCURACY], [1.0, 1.0], GDPO_MASK, GDPO_UIDS))
    assert not torch.allclose(gdpo, ref_gdpo([summed], [1.0], GDPO_MASK, GDPO_UIDS))


def test_gdpo_without_batch_data_normalises_token_level_rewards():
    data, _ = _gdpo_data()
    adv, _ = compute_gdpo_outcome_advantage(data.batch["token_level_rewards"], GDPO_MASK, GDPO_UIDS)
    summed = [f + a for f, a in zip(FORMAT, ACCURACY)]
    _close(adv, ref_gdpo([summed], [1.0], GDPO_MASK, GDPO_UIDS))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gdpo_reward_keys": None}, "algorithm.gdpo_reward_keys"),
        ({"gdpo_reward_keys": ["format", "missing"]}, "GDPO reward key 'missing' not found"),
        ({"gdpo_reward_weights": [1.0]}, "gdpo_reward_weights has 1 entries"),
    ],
)
def test_gdpo_config_errors_name_the_key(change, message):
    data, config = _gdpo_data()
    with pytest.raises(ValueError, match=message):
        compute_advantage(data, AdvantageEstimator.GDPO, config=OmegaConf.create({**config, **change}))


def test_gdpo_metrics_use_verls_names():
    data, _ = _gdpo_data()
    metrics = compute_gdpo_metrics(data, ["format", "accuracy", "absent"])
    assert sorted(metrics) == sorted(
        f"gdpo/{k}/{s}" for k in ("format", "accuracy") for s in ("mean", "std", "max", "min")
    )
    assert metrics["gdpo/accuracy/mean"] == pytest.approx(statistics.mean(ACCURACY))
    assert metrics["gdpo/accuracy/std"] == pytest.approx(statistics.pstdev(ACCURACY))
    assert metrics["gdpo/format/max"] == 1.0 and metrics["gdpo/format/min"] == 0.0


# -------------------------------------------------------------------------------------- actor sum_pi_squared
def test_sum_pi_squared_from_logits_chunked_equals_softmax_squared(monkeypatch):
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 4
    expected = (torch.softmax(logits, -1) ** 2).sum(-1)
    _close(verl_F.calculate_sum_pi_squared_from_logits(logits), expected)
    monkeypatch.setattr(verl_F, "LOGPROB_CHUNK_ELEMENTS", 22)  # two rows per chunk
    _close(verl_F.calculate_sum_pi_squared_from_logits(logits), expected)


PROMPT_LEN, RESPONSE_LEN, VOCAB = 5, 4, 64


def _tiny_actor_batch(temperature: float) -> tuple[Qwen2ForCausalLM, DataProto]:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config)
    prompt_lens, response_lens = torch.tensor([2, 5, 3, 4, 5]), torch.tensor([4, 1, 3, 2, 4])
    gen = torch.Generator().manual_seed(1)
    prompt_mask = torch.arange(PROMPT_LEN).expand(5, -1) >= (PROMPT_LEN - prompt_lens).unsqueeze(1)
    response_mask = torch.arange(RESPONSE_LEN).expand(5, -1) < response_lens.unsqueeze(1)
    prompts = torch.randint(1, VOCAB, (5, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (5, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    data = DataProto.from_dict(
        tensors={
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask.long(),
        },
        meta_info={"temperature": temperature, "micro_batch_size": 2},
    )
    return model, data


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_actor_sum_pi_squared_is_the_sum_of_squared_softmax(use_remove_padding):
    temperature = 0.7
    model, data = _tiny_actor_batch(temperature)
    actor = DataParallelPPOActor(
        OmegaConf.create({"use_remove_padding": use_remove_padding, "ppo_micro_batch_size_per_gpu": 2}), model
    )

    log_probs, entropys, sum_pi_squared = actor.compute_log_prob(
        data, calculate_entropy=True, calculate_sum_pi_squared=True
    )

    b = data.batch
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    expected = torch.zeros(5, RESPONSE_LEN)
    for i in range(5):
        for t in range(RESPONSE_LEN):
            probs = torch.softmax(logits[i, PROMPT_LEN - 1 + t].double() / temperature, dim=-1)
            expected[i, t] = float((probs**2).sum())
    mask = b["response_mask"].bool()
    assert sum_pi_squared.shape == (5, RESPONSE_LEN) and sum_pi_squared.dtype == torch.float32
    _close(sum_pi_squared[mask], expected[mask])
    assert ((sum_pi_squared[mask] > 1 / VOCAB) & (sum_pi_squared[mask] <= 1)).all()
    assert len(actor.compute_log_prob(data, calculate_entropy=True)) == 2  # unchanged without the flag
    _close(actor.compute_log_prob(data)[0], log_probs)


# ---------------------------------------------------------------------------------------------- end to end
# A reward whose two parts vary with the text, so that a random tiny model's responses get non-zero advantages.
TEXT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    fmt = float(len(solution_str) % 2)
    acc = float(sum(map(ord, solution_str)) % 5)
    return {"score": fmt + acc, "fmt": fmt, "acc": acc}
"""


@pytest.mark.slow
def test_optimal_token_baseline_and_gdpo_runs_train(tiny_model_dir, tmp_path):
    from tests.ppo_e2e import grpo_args, run_ppo, step_metrics, write_data

    data_dir = write_data(tmp_path, n_train=4)
    reward_file = tmp_path / "text_reward.py"
    reward_file.write_text(TEXT_REWARD)
    runs = {
        "otb": [
            "algorithm.adv_estimator=optimal_token_baseline",
            "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
        ],
        "gdpo": ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]"],
    }
    for name, extra in runs.items():
        run_dir = tmp_path / name
        args = grpo_args(tiny_model_dir, data_dir, run_dir, "trainer.total_training_steps=1", "trainer.save_freq=-1",
                         "trainer.single_process=true", "actor_rollout_ref.actor.use_kl_loss=false",
                         f"reward.custom_reward_function.path={reward_file}", *extra)  # fmt: skip
        run_ppo(args, tmp_path)
        step = step_metrics(run_dir)[1]
        assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["critic/advantages/mean"]), step
        assert 0 < step["actor/grad_norm"] < math.inf, step  # the actor got a gradient from these advantages
        if name == "gdpo":
            assert {"gdpo/fmt/mean", "gdpo/acc/std"} <= set(step), sorted(step)
