"""Tests for the SFT dataset (loss mask, padding, truncation, errors) and the FSDP2 SFT trainer (1 and 2 ranks)."""

import contextlib
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.trainer.fsdp_sft_trainer import (
    _forward,
    _to_device,
    build_model,
    default_sft_config,
    enter_acceleration,
    micro_batch_loss,
    run_sft,
    sft_loss,
)
from verl.utils.dataset.sft_dataset import SFTDataset
from verl.utils.fsdp_utils import free_port

TWO_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": '<think>use the tool</think>\n<tool_call>\n{"name": "get_weather"}\n</tool_call>'},
    {"role": "user", "content": "Thanks, and 12 + 30?"},
    {"role": "assistant", "content": "<response>42</response>"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _write(tmp_path, name, rows):
    path = str(tmp_path / name)
    pd.DataFrame(rows).to_parquet(path)
    return path


def _enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ dataset
def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer, tmp_path):
    path = _write(tmp_path, "chat.parquet", [{"messages": TWO_TURNS}])
    item = SFTDataset(path, tokenizer, {"max_length": 160})[0]
    # reference built turn by turn: "<|im_start|>{role}\n" header, then content + "<|im_end|>", then "\n"
    expected_ids, expected_mask = [], []
    for msg in TWO_TURNS:
        header = _enc(tokenizer, f"<|im_start|>{msg['role']}\n")
        body = _enc(tokenizer, msg["content"] + "<|im_end|>")
        newline = _enc(tokenizer, "\n")
        trained = int(msg["role"] == "assistant")
        expected_ids += header + body + newline
        expected_mask += [0] * len(header) + [trained] * len(body) + [0] * len(newline)
    n = len(expected_ids)
    assert item["input_ids"][:n].tolist() == expected_ids
    assert item["loss_mask"][:n].tolist() == expected_mask
    assert item["loss_mask"][n:].sum() == 0
    trained_text = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
    assert trained_text == TWO_TURNS[2]["content"] + "<|im_end|>" + TWO_TURNS[4]["content"] + "<|im_end|>"
    # right padding with the pad token; positions count real tokens only
    assert item["attention_mask"].tolist() == [1] * n + [0] * (160 - n)
    assert (item["input_ids"][n:] == tokenizer.pad_token_id).all()
    assert item["position_ids"][:n].tolist() == list(range(n))


def test_each_row_is_tokenized_once_and_reads_back_the_same(tokenizer, tmp_path, monkeypatch):
    path = _write(tmp_path, "chat.parquet", [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:3]}])
    dataset = SFTDataset(path, tokenizer, {"max_length": 160, "truncation": "right"})
    renders = []
    real_render = type(tokenizer).apply_chat_template
    monkeypatch.setattr(
        type(tokenizer), "apply_chat_template", lambda *a, **k: renders.append(1) or real_render(*a, **k)
    )
    first = [dataset[i] for i in range(2)]
    assert len(renders) == 7 + 4  # prefix renderings: 5 messages + 2 assistant headers, 3 messages + 1
    ids, mask = dataset.tokenize(0)
    ids.append(7), mask.append(1)  # a caller changing the lists does not change the kept rows
    again = [dataset[i] for i in range(2)]
    assert len(renders) == 11  # the second epoch renders nothing
    for a, b in zip(first, again):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_prompt_response_columns(tokenizer, tmp_path):
    # two files (a parquet column holds one type): string prompts, then chat-list prompts
    strings = _write(tmp_path, "pr_str.parquet", [{"question": "What is 2+2?", "answer": "4"}])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chats = _write(tmp_path, "pr_chat.parquet", [{"question": chat, "answer": "Hello"}])
    ds = SFTDataset([strings, chats], tokenizer, {"prompt_key": "question", "response_key": "answer", "max_length": 64})
    assert len(ds) == 2
    first = ds[0]
    prompt_ids = _enc(tokenizer, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    response_ids = _enc(tokenizer, "4<|im_end|>")
    n = len(prompt_ids) + len(response_ids)
    assert first["input_ids"][:n].tolist() == prompt_ids + response_ids
    assert first["loss_mask"].tolist() == [0] * len(prompt_ids) + [1] * len(response_ids) + [0] * (64 - n)
    second = ds[1]
    assert tokenizer.decode(second["input_ids"][second["loss_mask"].bool()]) == "Hello<|im_end|>"
    assert tokenizer.decode(second["input_ids"][second["attention_mask"].bool()]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
    )


def test_truncation_modes(tokenizer, tmp_path):
    path = _write(tmp_path, "chat.parquet", [{"messages": TWO_TURNS}])
    full = SFTDataset(path, tokenizer, {"max_length": 160})
    ids, mask = full.tokenize(0)
    left = SFTDataset(path, tokenizer, {"max_length": 10, "truncation": "left"})[0]
    right = SFTDataset(path, tokenizer, {"max_length": 10, "truncation": "right"})[0]
    assert left["input_ids"].tolist() == ids[-10:] and left["loss_mask"].tolist() == mask[-10:]
    assert right["input_ids"].tolist() == ids[:10] and right["loss_mask"].tolist() == mask[:10]
    assert left["attention_mask"].sum() == 10
    with pytest.raises(ValueError, match=r"chat.parquet row 0: \d+ tokens exceed data.max_length=10"):
        SFTDataset(path, tokenizer, {"max_length": 10})[0]
    with pytest.raises(ValueError, match="data.truncation='middle' is not supported"):
        SFTDataset(path, tokenizer, {"truncation": "middle"})


def test_errors_name_the_file_and_columns(tokenizer, tmp_path):
    path = _write(tmp_path, "bad.parquet", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"bad.parquet.*columns \['text'\].*'messages'"):
        SFTDataset(path, tokenizer, {})
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        SFTDataset(str(tmp_path / "missing.parquet"), tokenizer, {})
    no_assistant = _write(tmp_path, "noasst.parquet", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="noasst.parquet row 0: the conversation has no assistant message"):
        SFTDataset(no_assistant, tokenizer, {})[0]


# --------------------------------------------------------------------------------------------- loss
def test_sft_loss_matches_hand_computed_cross_entropy():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]])  # (1, 3, vocab 3)
    input_ids = torch.tensor([[0, 1, 2]])
    loss_mask = torch.tensor([[0, 0, 1]])  # only token 2 (predicted from position 1) is a target
    summed, count = sft_loss(logits, input_ids, loss_mask)
    # -log softmax([0, 1, 0])[2] = log(e^0 + e^1 + e^0) - 0
    expected = torch.log(torch.tensor(2.0 + torch.e))
    assert count.item() == 1
    assert torch.allclose(summed, expected)
    summed_all, count_all = sft_loss(logits, input_ids, torch.tensor([[0, 1, 1]]))
    # token 1 from position 0: log(e^2 + 1 + 1) - 0
    assert count_all.item() == 2
    assert torch.allclose(summed_all, expected + torch.log(torch.tensor(torch.e**2 + 2)))


def test_batches_cut_to_longest_sequence_give_the_same_loss_and_gradients(tokenizer, tiny_model_dir, tmp_path):
    path = _write(tmp_path, "chat.parquet", [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:3]}])
    dataset = SFTDataset(path, tokenizer, {"max_length": 256})
    full = {k: torch.stack([dataset[0][k], dataset[1][k]]) for k in dataset[0]}
    cut = _to_device(full, "cpu")
    longest = int(full["attention_mask"].sum(-1).max())
    assert full["input_ids"].shape[1] == 256 and cut["input_ids"].shape[1] == longest < 256
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    results = []
    for batch in (full, cut):
        model.zero_grad()
        summed, count = sft_loss(_forward(model, batch), batch["input_ids"], batch["loss_mask"])
        summed.backward()
        results.append((summed.detach(), count, model.lm_head.weight.grad.clone()))
    assert results[0][1] == results[1][1]
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][2], results[1][2], atol=1e-5)


def test_head_only_from_the_first_target_column_gives_the_same_loss_and_gradients(tokenizer, tiny_model_dir, tmp_path):
    long_prompt = [{"role": "system", "content": "You can call tools. " * 6}] + TWO_TURNS[1:3]
    path = _write(tmp_path, "chat.parquet", [{"messages": TWO_TURNS}, {"messages": long_prompt}])
    dataset = SFTDataset(path, tokenizer, {"max_length": 256})
    batch = _to_device({k: torch.stack([dataset[0][k], dataset[1][k]]) for k in dataset[0]}, "cpu")
    # the column predicting the batch's first target token: row 0's first assistant reply starts earlier
    first = int(batch["loss_mask"][:, 1:].any(0).nonzero()[0])
    assert 10 < first and not batch["loss_mask"][:, : first + 1].any()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows_projected = []
    model.lm_head.register_forward_hook(lambda mod, args, out: rows_projected.append(out.shape[1]))
    results = []
    for trim in (False, True):
        model.zero_grad()
        summed, count = micro_batch_loss(model, batch, trim)
        summed.backward()
        results.append((summed.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    width = batch["input_ids"].shape[1]
    assert rows_projected == [width, width - first]  # the head skipped the prompt columns before `first`
    assert results[0][1] == results[1][1] == batch["loss_mask"][:, 1:].sum()
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-6)
    for name, grad in results[0][2].items():
        assert torch.allclose(grad, results[1][2][name], rtol=1e-5, atol=1e-7), name


def test_packed_examples_give_the_same_loss_and_gradients_as_the_padded_batch(tokenizer, tiny_model_dir, tmp_path):
    long_prompt = [{"role": "system", "content": "You can call tools. " * 6}] + TWO_TURNS[1:3]
    rows = [{"messages": TWO_TURNS}, {"messages": long_prompt}, {"messages": TWO_TURNS[:3]}]
    dataset = SFTDataset(_write(tmp_path, "chat.parquet", rows), tokenizer, {"max_length": 256})
    batch = _to_device({k: torch.stack([dataset[i][k] for i in range(3)]) for k in dataset[0]}, "cpu")
    lengths = batch["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) == 3  # rows 1 and 2 padded in the right-padded batch
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head_rows = []
    model.lm_head.register_forward_hook(lambda mod, args, out: head_rows.append(out.shape[:2]))
    results = []
    for packed in (False, True):
        model.zero_grad()
        summed, count = micro_batch_loss(model, batch, trim=True, packed=packed)
        summed.backward()
        results.append((summed.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    targets = int(batch["loss_mask"][:, 1:].sum())
    # packed: one row of the 3 examples' real tokens, the head only at the positions predicting a target
    assert head_rows[1] == (1, targets)
    assert results[0][1] == results[1][1] == targets
    # attention stays inside each example: a packed row attending across examples would change the loss
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-6)
    for name, grad in results[0][2].items():
        # summed in another order: ~3e-7 of the tensor's largest element (the random model's gradients reach ~30)
        assert torch.allclose(grad, results[1][2][name], rtol=1e-5, atol=1e-6 * float(grad.abs().max())), name


def test_lean_activations_switch_the_layers_and_train_the_same(tokenizer, tiny_model_dir, tmp_path):
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:3]}]
    dataset = SFTDataset(_write(tmp_path, "chat.parquet", rows), tokenizer, {"max_length": 256})
    batch = _to_device({k: torch.stack([dataset[i][k] for i in range(2)]) for k in dataset[0]}, "cpu")
    results = []
    with _one_rank_group():
        for lean in (False, True):
            model_cfg = default_sft_config().model
            model_cfg.update(partial_pretrain=tiny_model_dir, lean_activations=lean)
            model = build_model(model_cfg, "cpu")
            switched = [name for name, m in model.named_modules() if hasattr(m, "_hf_forward")]
            summed, _ = micro_batch_loss(model, batch, trim=True, packed=True)
            summed.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results.append((switched, summed.detach(), grads))
            layers = model.config.num_hidden_layers
    assert results[0][0] == []
    assert len(results[1][0]) == layers * 3 + 1  # per layer two RMSNorms and the MLP, and the final norm
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-6)
    for name, grad in results[0][2].items():
        assert torch.allclose(grad, results[1][2][name], rtol=1e-5, atol=1e-6 * float(grad.abs().max())), name


@contextlib.contextmanager
def _one_rank_group():
    """A 1-rank gloo process group for FSDP2 (as `run_sft` makes when none exists)."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("env, adaptive", [({}, True), ({"VERL_ADAPTIVE_THREADS": "0"}, False)])
def test_cpu_steps_pick_their_thread_count_unless_told_not_to(monkeypatch, env, adaptive):
    from verl.cpu import threads
    from verl.utils import acceleration

    monkeypatch.delenv("VERL_ADAPTIVE_THREADS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert enter_acceleration("cpu", 2).name == "cpu"
        assert (threads._POLICY is not None) == adaptive
        if adaptive:
            assert threads._POLICY.share == 2  # at most the given count
        assert os.environ.get("VERL_ADAPTIVE_THREADS") == env.get("VERL_ADAPTIVE_THREADS")  # environment restored
        acceleration.leave()
        assert threads._POLICY is None
        assert enter_acceleration("cuda", 2) is acceleration.GENERIC  # a GPU: no CPU speed-up at all
        acceleration.leave()
        monkeypatch.setenv("VERL_ADAPTIVE_THREADS", "yes")
        with pytest.raises(ValueError, match="VERL_ADAPTIVE_THREADS must be 0 or 1, got 'yes'"):
            enter_acceleration("cpu", 2)
    finally:
        acceleration.leave()


# ------------------------------------------------------------------------------------------ trainer
def _synthetic_rows(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(1, 50, (2,), generator=g))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {
                        "role": "assistant",
                        "content": f"<think>{a} + {b} = {a + b}</think>\n<response>{a + b}</response>",
                    },
                ]
            }
        )
    return rows


def _sft_config(model_dir, train, out, steps, batch=8, micro=2):
    return {
        "data": {"train_files": train, "max_length": 48, "train_batch_size": batch, "micro_batch_size_per_gpu": micro},
        "model": {"partial_pretrain": model_dir},
        "optim": {"lr": 2e-3, "warmup_steps_ratio": 0.0, "lr_scheduler": "constant"},
        "trainer": {"default_local_dir": out, "total_training_steps": steps, "seed": 3, "device": "cpu", "logger": []},
    }


def _mean_loss(model_dir, dataset):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batch = {k: torch.stack([dataset[i][k] for i in range(len(dataset))]) for k in dataset[0]}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    summed, count = sft_loss(logits, batch["input_ids"], batch["loss_mask"])
    return (summed / count).item()


@pytest.fixture(scope="module")
def one_rank_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    train = _write(root, "train.parquet", _synthetic_rows())
    config = _sft_config(tiny_model_dir, train, str(root / "out1"), steps=6)
    config["data"]["val_files"] = _write(root, "val.parquet", _synthetic_rows(n=6, seed=1))
    config["trainer"].update(save_freq=4, test_freq=3)
    final = run_sft(config)
    return train, final


def test_short_sft_lowers_loss_and_writes_hf_checkpoint(one_rank_run, tiny_model_dir, tokenizer):
    train, final = one_rank_run
    assert os.path.basename(final) == "global_step_6"
    assert not os.path.exists(final + ".tmp")
    dataset = SFTDataset(train, tokenizer, {"max_length": 48})
    before, after = _mean_loss(tiny_model_dir, dataset), _mean_loss(final, dataset)
    assert after < before - 0.5, (before, after)
    reloaded_tok = AutoTokenizer.from_pretrained(final)
    assert reloaded_tok("<think>12 + 3</think>")["input_ids"] == tokenizer("<think>12 + 3</think>")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    root = os.path.dirname(final)
    assert sorted(os.listdir(root)) == [
        "global_step_4",
        "global_step_6",
        "latest_checkpointed_iteration.txt",
        "metrics.jsonl",
    ]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "6"
    metrics = pd.read_json(os.path.join(root, "metrics.jsonl"), lines=True)
    assert metrics["step"].tolist() == list(range(1, 7))
    val = metrics["val/loss"]
    assert val.notna().tolist() == [False, False, True, False, False, True]  # test_freq=3
    assert val[5] < val[2] and (metrics["train/loss"].iloc[-2:].mean() < metrics["train/loss"].iloc[:2].mean())


@pytest.mark.slow
def test_two_ranks_match_one_rank(one_rank_run, tiny_model_dir, tmp_path):
    train, final_one = one_rank_run
    out = str(tmp_path / "out2")
    cfg = _sft_config(tiny_model_dir, train, out, steps=6)
    overrides = [f"{section}.{k}={v}" for section, values in cfg.items() for k, v in values.items()]
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "verl.trainer.fsdp_sft_trainer", *overrides]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    one = AutoModelForCausalLM.from_pretrained(final_one).state_dict()
    two = AutoModelForCausalLM.from_pretrained(os.path.join(out, "global_step_6")).state_dict()
    assert one.keys() == two.keys()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert not torch.allclose(one["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    # Two ranks reduce gradients in another order than one (and run 1 thread each): rounding differs. AdamW divides
    # each element's gradient by its own running scale, so an element whose gradient is near rounding noise can move
    # by a different part of lr (2e-3) per step: a few elements differ by ~1e-5 after 6 steps (seen: 1.1e-5 on a
    # Sapphire Rapids CPU). Wrong data sharding or a rank's gradient left out would move nearly every element by ~lr.
    diffs = {key: (one[key] - two[key]).abs() for key in one}
    for key, diff in diffs.items():
        assert diff.max() <= 1e-4, (key, diff.max())
    mean_diff = sum(float(d.sum()) for d in diffs.values()) / sum(d.numel() for d in diffs.values())
    assert mean_diff <= 1e-7, mean_diff
