"""Tests of verl/utils/dataset/rl_dataset.py: padding, truncation, filtering, errors, collation, the sampler."""

import logging
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from verl.utils.dataset.rl_dataset import ResumableSampler, RLHFDataset, collate_fn, create_rl_sampler


def render(messages):
    """The Qwen-style chat template written out by hand (add_generation_prompt=True)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def ref_ids(tokenizer, messages):
    return tokenizer(render(messages), add_special_tokens=False)["input_ids"]


def chat(user, system=None):
    messages = [{"role": "user", "content": user}]
    return ([{"role": "system", "content": system}] if system else []) + messages


def row(user, index=None, **extra):
    r = {"data_source": "unit", "prompt": chat(user), "reward_model": {"style": "rule", "ground_truth": "42"}}
    if index is not None:
        r["extra_info"] = {"split": "train", "index": index}
    r.update(extra)
    return r


LONG = "the quick brown fox jumps over the lazy dog " * 12


def test_left_padding_and_positions(tokenizer, write_parquet):
    path = write_parquet([row("What is 6 times 7?", index=5)])
    ds = RLHFDataset(path, tokenizer, {"max_prompt_length": 48})
    item = ds[0]
    ids = ref_ids(tokenizer, chat("What is 6 times 7?"))
    n, pad = len(ids), tokenizer.pad_token_id
    assert n < 48
    assert item["input_ids"].tolist() == [pad] * (48 - n) + ids
    assert item["attention_mask"].tolist() == [0] * (48 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (48 - n) + list(range(n))
    assert item["raw_prompt_ids"] == ids
    assert item["input_ids"].dtype == torch.int64
    assert item["index"] == 5
    assert item["data_source"] == "unit"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "42"}
    assert item["extra_info"] == {"split": "train", "index": 5}
    assert "prompt" not in item and "raw_prompt" not in item and "full_prompts" not in item


def test_return_raw_chat_and_full_prompt(tokenizer, write_parquet):
    messages = chat("hello there", system="be brief")
    path = write_parquet([{"prompt": messages, "data_source": "unit"}])
    item = RLHFDataset(path, tokenizer, {"max_prompt_length": 64, "return_raw_chat": True, "return_full_prompt": True})[
        0
    ]
    assert item["raw_prompt"] == messages
    assert item["full_prompts"] == render(messages)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tokenizer, write_parquet, mode):
    ids = ref_ids(tokenizer, chat(LONG))
    max_len = 17
    assert len(ids) > max_len
    expected = {
        "left": ids[-max_len:],
        "right": ids[:max_len],
        "middle": ids[: max_len // 2] + ids[len(ids) - (max_len - max_len // 2) :],
    }[mode]
    path = write_parquet([row(LONG)])
    config = {"max_prompt_length": max_len, "truncation": mode, "filter_overlong_prompts": False}
    item = RLHFDataset(path, tokenizer, config)[0]
    assert item["input_ids"].tolist() == expected
    assert item["attention_mask"].tolist() == [1] * max_len
    assert item["position_ids"].tolist() == list(range(max_len))
    assert item["raw_prompt_ids"] == expected


def test_truncation_error_names_row_and_lengths(tokenizer, write_parquet):
    n = len(ref_ids(tokenizer, chat(LONG)))
    path = write_parquet([row("short"), row(LONG)])
    with pytest.raises(ValueError) as err:  # at load time, not when the long row is first drawn mid-run
        RLHFDataset(path, tokenizer, {"max_prompt_length": 20, "truncation": "error", "filter_overlong_prompts": False})
    message = str(err.value)
    assert path in message and "row 1" in message and str(n) in message and "20" in message


def test_filter_overlong_prompts_drops_rows_and_logs(tokenizer, write_parquet, caplog):
    short_len = len(ref_ids(tokenizer, chat("short one")))
    rows = [row("short one", index=10), row(LONG, index=11), row("short one", index=12), row(LONG, index=13)]
    path = write_parquet(rows)
    with caplog.at_level(logging.WARNING, logger="verl.utils.dataset.rl_dataset"):
        ds = RLHFDataset(path, tokenizer, {"max_prompt_length": short_len, "truncation": "error"})
    assert len(ds) == 2
    assert [ds[i]["index"] for i in range(2)] == [10, 12]
    assert "dropped 2 of 4" in caplog.text
    # A prompt of exactly max_prompt_length is kept, unpadded.
    assert ds[0]["attention_mask"].tolist() == [1] * short_len


def test_filter_keeps_nothing_is_an_error(tokenizer, write_parquet):
    path = write_parquet([row(LONG)])
    with pytest.raises(ValueError, match="every prompt"):
        RLHFDataset(path, tokenizer, {"max_prompt_length": 8})


def test_many_files_index_falls_back_to_row_number(tokenizer, write_parquet):
    first = write_parquet([row("a"), row(LONG), row("b")], name="first.parquet")
    second = write_parquet([row("c", ability="math")], name="second.parquet")
    ds = RLHFDataset([first, second], tokenizer, {"max_prompt_length": 32})
    assert len(ds) == 3  # the long row is filtered
    # Row numbers count over all files before filtering.
    assert [ds[i]["index"] for i in range(3)] == [0, 2, 3]
    # Columns of the files are unioned: the first file's rows carry ability=None.
    assert [ds[i]["ability"] for i in range(3)] == [None, None, "math"]


def test_collate_fn_and_dataproto(tokenizer, write_parquet):
    path = write_parquet([row("one", index=0), row("two two", index=1), row("three three three", index=2)])
    ds = RLHFDataset(path, tokenizer, {"max_prompt_length": 32, "return_raw_chat": True})
    batch = collate_fn([ds[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 32)
    assert batch["position_ids"].shape == (3, 32)
    for key in ("raw_prompt_ids", "raw_prompt", "reward_model", "extra_info", "data_source", "index"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object and batch[key].shape == (3,)
    assert batch["raw_prompt_ids"][1] == ref_ids(tokenizer, chat("two two"))
    assert batch["index"].tolist() == [0, 1, 2]
    protocol = pytest.importorskip("verl.protocol")
    data = protocol.DataProto.from_single_dict(batch)
    assert len(data) == 3
    assert set(data.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    assert data.non_tensor_batch["raw_prompt"][2] == chat("three three three")


def test_collate_equal_length_lists_stay_objects():
    batch = collate_fn([{"ids": [1, 2]}, {"ids": [3, 4]}])
    assert batch["ids"].shape == (2,) and batch["ids"][1] == [3, 4]
    with pytest.raises(ValueError, match="keys"):
        collate_fn([{"a": 1}, {"b": 2}])


def test_dataset_pickles(tokenizer, write_parquet):
    ds = RLHFDataset(write_parquet([row("pickle me", index=3)]), tokenizer, {"max_prompt_length": 24})
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[0]["input_ids"].tolist() == ds[0]["input_ids"].tolist()
    assert clone[0]["index"] == 3


# ------------------------------------------------------------------------------------------------ errors
def test_missing_file(tokenizer, tmp_path):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="nope.parquet"):
        RLHFDataset(missing, tokenizer, {})


def test_missing_prompt_column_lists_columns(tokenizer, write_parquet):
    path = write_parquet([{"question": "hi", "data_source": "x"}])
    with pytest.raises(ValueError) as err:
        RLHFDataset(path, tokenizer, {})
    assert "'prompt'" in str(err.value) and "question" in str(err.value) and "data_source" in str(err.value)


def test_empty_dataset(tokenizer, write_parquet):
    import pyarrow as pa

    schema = pa.schema([("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    path = write_parquet([], schema=schema)
    with pytest.raises(ValueError, match="empty"):
        RLHFDataset(path, tokenizer, {})


@pytest.mark.parametrize(
    "prompt, fragment",
    [("just a string", "list of chat messages"), ([{"content": "no role"}], "message 0"), ([], "non-empty")],
)
def test_bad_prompt_names_file_and_row(tokenizer, write_parquet, prompt, fragment):
    good = {"prompt": chat("fine")}
    if isinstance(prompt, str):
        rows = [{"prompt": "fine"}, {"prompt": prompt}]  # a string column
        expect_row = "row 0"
    else:
        rows = [good, {"prompt": prompt}]
        expect_row = "row 1"
    path = write_parquet(rows)
    with pytest.raises(ValueError) as err:
        RLHFDataset(path, tokenizer, {})
    assert path in str(err.value) and expect_row in str(err.value) and fragment in str(err.value)


def test_tokenizer_without_chat_template(tokenizer, write_parquet):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        RLHFDataset(write_parquet([row("x")]), plain, {})


def test_bad_truncation_value(tokenizer, write_parquet):
    with pytest.raises(ValueError, match="truncation"):
        RLHFDataset(write_parquet([row("x")]), tokenizer, {"truncation": "both"})


# ----------------------------------------------------------------------------------------------- sampler
def test_shuffled_sampler_matches_random_sampler_over_epochs():
    data = list(range(13))
    generator = torch.Generator()
    generator.manual_seed(7)
    reference = RandomSampler(data, generator=generator)
    sampler = ResumableSampler(13, shuffle=True, seed=7)
    for _ in range(3):
        assert list(sampler) == list(reference)


def test_sequential_sampler_and_create_rl_sampler():
    data = list(range(5))
    assert list(create_rl_sampler({"shuffle": False}, data)) == [0, 1, 2, 3, 4]
    shuffled = create_rl_sampler({"shuffle": True, "seed": 3}, data)
    assert sorted(shuffled) == data and shuffled.seed == 3
    assert create_rl_sampler({}, data).seed == 1 and create_rl_sampler({}, data).shuffle


def _consume(loader, n_batches):
    out, it = [], iter(loader)
    for _ in range(n_batches):
        out.append(next(it).tolist())
    return out


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # mid-epoch, end of epoch, start of the next, mid next
def test_sampler_resume_gives_the_same_order(stop_after):
    data = torch.arange(10)
    total_batches = 9  # 3 epochs of 3 batches (batch 3, drop_last) -> resume crosses epoch boundaries

    def loader(sampler):
        return DataLoader(data, batch_size=3, sampler=sampler, drop_last=True, num_workers=0)

    def batches(sampler, n):
        out = []
        while len(out) < n:
            for b in loader(sampler):
                out.append(b.tolist())
                if len(out) == n:
                    break
        return out

    uninterrupted = batches(ResumableSampler(10, shuffle=True, seed=5), total_batches)
    first = ResumableSampler(10, shuffle=True, seed=5)
    head = batches(first, stop_after)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = ResumableSampler(10, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    tail = batches(resumed, total_batches - stop_after)
    assert head + tail == uninterrupted
    # Each epoch is a permutation minus the dropped tail.
    assert len({i for b in uninterrupted[:3] for i in b}) == 9


def test_sampler_state_mismatch_is_an_error():
    state = ResumableSampler(10, seed=5).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        ResumableSampler(11, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=6).load_state_dict(state)
