"""Multi-domain data: the per-step split by probabilities (exact totals), each domain's own resumable order, the
domain config checks, and the dataset that batches domains together."""

import os

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.domains import (
    DomainSampler,
    build_domain_datasets,
    correct_thresholds,
    parse_domains,
    split_batch_size,
)
from verl.utils.dataset.rl_dataset import collate_fn


# ------------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize(
    "probs, total, expected",
    [
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 8, {"a": 4, "b": 2, "c": 2}),  # 4, 2.4, 1.6: the .6 gets the spare
        ({"a": 0.1, "b": 0.2, "c": 0.7}, 10, {"a": 1, "b": 2, "c": 7}),  # 0.7 * 10 = 7.000000000000001 stays 7
        ({"a": 0.3, "b": 0.7}, 10, {"a": 3, "b": 7}),  # 0.3 * 10 = 3.0000000000000004
        ({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, 4, {"a": 2, "b": 1, "c": 1}),  # equal remainders: config order
        ({"a": 0.05, "b": 0.95}, 4, {"a": 0, "b": 4}),  # 0.2 and 3.8
        ({"a": 1.0}, 5, {"a": 5}),
    ],
)
def test_split_is_largest_remainder_with_exact_total(probs, total, expected):
    counts = split_batch_size(probs, total)
    assert counts == expected
    assert sum(counts.values()) == total


def test_split_totals_are_exact_for_many_sizes():
    probs = {"math": 0.45, "code": 0.35, "tools": 0.2}
    for total in range(1, 200):
        counts = split_batch_size(probs, total)
        assert sum(counts.values()) == total
        for name, p in probs.items():  # each share is its exact value rounded down or up
            assert abs(counts[name] - p * total) < 1


# ------------------------------------------------------------------------------------------------- the sampler
def _perm_check(draws, size):
    seen = [row for draw in draws for row in draw]
    return sorted(seen) == list(range(size))


def test_each_domain_has_its_own_order_and_epochs():
    sampler = DomainSampler({"a": 6, "b": 4}, {"a": 3, "b": 2}, seed=7)
    first, second = sampler.draw(), sampler.draw()
    assert list(first) == ["a", "b"] and [len(v) for v in first.values()] == [3, 2]
    assert _perm_check([first["a"], second["a"]], 6)  # domain a: one full epoch, no repeats
    assert _perm_check([first["b"], second["b"]], 4)
    third = sampler.draw()  # both domains start their second epoch: a new permutation each
    assert sampler.state_dict()["domains"]["a"] == {"epoch": 1, "position": 3, "num_rows": 6}
    assert sampler.batches == 3 and _perm_check([third["b"]], 4) is False  # half of b's second epoch
    # the domain order does not depend on the other domains: b alone, same seed, same rows
    alone = DomainSampler({"b": 4}, {"b": 2}, seed=7)
    assert [alone.draw()["b"] for _ in range(3)] == [first["b"], second["b"], third["b"]]
    # a draw crossing an epoch boundary takes the rest of the epoch, then the start of the next one
    odd = DomainSampler({"c": 5}, {"c": 3}, seed=1)
    rows = odd.draw()["c"] + odd.draw()["c"]
    assert sorted(rows[:5]) == list(range(5)) and odd.state_dict()["domains"]["c"]["epoch"] == 1


def test_resume_continues_every_domain_exactly():
    sizes, quotas = {"math": 7, "code": 5, "tools": 3}, {"math": 3, "code": 2, "tools": 1}
    full = DomainSampler(sizes, quotas, seed=3)
    straight = [full.draw() for _ in range(6)]
    first = DomainSampler(sizes, quotas, seed=3)
    before = [first.draw() for _ in range(2)]
    first.draw({"code": 2})  # a dynamic-sampling round that only drew from one domain
    state = first.state_dict()
    resumed = DomainSampler(sizes, quotas, seed=3)
    resumed.load_state_dict(state)
    after = [resumed.draw() for _ in range(3)]
    assert before == straight[:2]
    assert [d["math"] for d in after] == [d["math"] for d in straight[2:5]]  # math never saw the extra round
    assert [d["tools"] for d in after] == [d["tools"] for d in straight[2:5]]
    code_stream = [r for d in straight for r in d["code"]]
    assert [r for d in after for r in d["code"]] == code_stream[6:12]  # code continues after the extra 2 rows
    assert resumed.batches == 5


def test_sampler_state_mismatch_and_small_domain_are_clear_errors():
    sampler = DomainSampler({"a": 4}, {"a": 2})
    with pytest.raises(ValueError, match="the checkpoint's domains \\['b'\\] differ from data.domains \\['a'\\]"):
        sampler.load_state_dict({"domains": {"b": {"epoch": 0, "position": 0, "num_rows": 4}}})
    with pytest.raises(ValueError, match="domain 'a' had 5 training prompts .* has 4 now"):
        sampler.load_state_dict({"domains": {"a": {"epoch": 0, "position": 0, "num_rows": 5}}})
    with pytest.raises(ValueError, match="domain 'a' has 2 training prompts, fewer than its share 3"):
        DomainSampler({"a": 2}, {"a": 3})


# ------------------------------------------------------------------------------------------------- config checks
def _config(tmp_path, domains, probs, **extra):
    data = {"domains": domains, "domain_interleave_probs": probs, "train_batch_size": 4, **extra.pop("data", {})}
    return OmegaConf.create({"data": data, **extra})


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name in ("m", "t"):
        path = tmp_path / f"{name}.parquet"
        pd.DataFrame({"x": [1]}).to_parquet(path)
        paths[name] = str(path)
    return paths


def test_parse_domains_merges_defaults_and_routes_rewards(tmp_path, files):
    cfg = _config(
        tmp_path,
        {
            "math": {"train_files": [files["m"]], "reward": "openai/gsm8k", "reward_clip": 2.0},
            "tools": {"train_files": files["t"], "val_files": [files["t"]], "reward": "rlla", "weight": 0.5},
        },
        {"math": 0.75, "tools": 0.25},
        algorithm={"reward_norm": "group", "reward_scale": 2.0},
        reward={"correct_threshold": 3.0},
    )
    specs, probs = parse_domains(cfg)
    math_spec, tools_spec = specs
    assert probs == {"math": 0.75, "tools": 0.25}
    assert (math_spec.reward_type, math_spec.data_source) == ("math_rule", "openai/gsm8k")
    assert (tools_spec.reward_type, tools_spec.data_source) == ("rlla", None)
    assert math_spec.reward_norm == "group" and math_spec.reward_clip == 2.0 and math_spec.reward_scale == 2.0
    assert tools_spec.weight == 0.5 and tools_spec.reward_clip is None and tools_spec.val_files == (files["t"],)
    assert math_spec.correct_threshold == 3.0
    assert correct_thresholds(cfg, ["tools", "math"], 2) == [3.0, 3.0]
    assert parse_domains(OmegaConf.create({"data": {"domains": None}})) is None


@pytest.mark.parametrize(
    "domains, probs, message",
    [
        ({"m": {"train_files": "M", "reward": "math_rule"}}, {"m": 0.9}, "must sum to 1, got 0.9"),
        ({"m": {"train_files": "M", "reward": "math_rule"}}, {"m": 0.5, "x": 0.5}, "names \\['x'\\], which are not"),
        (
            {"m": {"train_files": "M", "reward": "math_rule"}, "t": {"train_files": "T", "reward": "rlla"}},
            {"m": 1.0},
            "no probability for domain\\(s\\) \\['t'\\]",
        ),
        ({"m": {"reward": "math_rule"}}, {"m": 1.0}, "data.domains.m.train_files is missing"),
        ({"m": {"train_files": "M", "reward": "poetry"}}, {"m": 1.0}, "data.domains.m.reward='poetry' is not a known"),
        ({"m": {"train_files": "M"}}, {"m": 1.0}, "data.domains.m.reward is missing"),
        ({"m": {"train_files": "M", "reward": "rlla", "wieght": 2}}, {"m": 1.0}, "unknown keys \\['wieght'\\]"),
        ({"m": {"train_files": "M", "reward": "rlla", "reward_norm": "z"}}, {"m": 1.0}, "reward_norm='z'; allowed"),
        ({"m": {"train_files": "M", "reward": "rlla", "reward_clip": -1}}, {"m": 1.0}, "reward_clip=-1 must be > 0"),
        (
            {"m": {"train_files": "M", "reward": "rlla"}, "t": {"train_files": "T", "reward": "ifeval"}},
            {"m": -0.5, "t": 1.5},
            "data.domain_interleave_probs.m=-0.5 must be >= 0",
        ),
        (None, {"m": 1.0}, "is set but data.domains is empty"),
    ],
)
def test_bad_domain_config_is_one_clear_error(tmp_path, files, domains, probs, message):
    for entry in (domains or {}).values():
        if "train_files" in entry:
            entry["train_files"] = files["m"]
    with pytest.raises(ValueError, match=message):
        parse_domains(_config(tmp_path, domains, probs))


def test_missing_file_and_train_files_beside_domains_are_errors(tmp_path, files):
    cfg = _config(tmp_path, {"m": {"train_files": str(tmp_path / "nope.parquet"), "reward": "rlla"}}, {"m": 1.0})
    with pytest.raises(FileNotFoundError, match="data.domains.m.train_files: no such file"):
        parse_domains(cfg)
    cfg = _config(
        tmp_path, {"m": {"train_files": files["m"], "reward": "rlla"}}, {"m": 1.0}, data={"train_files": files["t"]}
    )
    with pytest.raises(ValueError, match="data.train_files is set together with data.domains"):
        parse_domains(cfg)


# ------------------------------------------------------------------------------------------------- the dataset
def _rows(source, n, extra_column=None):
    rows = []
    for i in range(n):
        row = {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"{source} question {i}"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        if extra_column:
            row[extra_column] = f"{extra_column}-{i}"
        rows.append(row)
    return rows


def test_multi_domain_dataset_batches_domains_together(tmp_path, tiny_model_dir):
    from verl.trainer.ppo.domains import DomainSpec
    from verl.utils.tokenizer import hf_tokenizer

    pd.DataFrame(_rows("openai/gsm8k", 5, extra_column="ability")).to_parquet(tmp_path / "math.parquet")
    pd.DataFrame(_rows("rlla", 3)).to_parquet(tmp_path / "tools.parquet")
    specs = [
        DomainSpec("math", (str(tmp_path / "math.parquet"),), (str(tmp_path / "math.parquet"),), "math_rule", None),
        DomainSpec("tools", (str(tmp_path / "tools.parquet"),), (), "rlla", None),
    ]
    tokenizer = hf_tokenizer(tiny_model_dir)
    train, val = build_domain_datasets(specs, tokenizer, OmegaConf.create({"max_prompt_length": 64}))
    assert len(train) == 8 and train.sizes() == {"math": 5, "tools": 3}
    assert list(val.sizes()) == ["math"]
    assert train.locate(5) == ("tools", 0) and train.global_rows({"tools": [2], "math": [0]}) == [7, 0]
    batch = DataProto.from_single_dict(collate_fn([train[i] for i in train.global_rows({"math": [4], "tools": [1]})]))
    assert list(batch.non_tensor_batch["domain"]) == ["math", "tools"]
    assert list(batch.non_tensor_batch["data_source"]) == ["openai/gsm8k", "rlla"]
    assert list(batch.non_tensor_batch["ability"]) == ["ability-4", None]  # a column only math has
    assert batch.batch["input_ids"].shape == (2, 64) and batch.batch["input_ids"].dtype == torch.long
    with pytest.raises(IndexError):
        train[8]
    assert os.path.isfile(tmp_path / "math.parquet")
