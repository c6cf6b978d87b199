"""Bad-input corpus: every case runs a real entry point as `python -m ...` would and must exit non-zero, end
stderr with one `error: ...` line naming the bad value (and/or what is allowed), and leave the files of an earlier
run (output parquet, checkpoint folder, metrics log) byte-for-byte and mtime-for-mtime untouched.

Cases marked `isolated` (one per entry point, and those that start Ray) run in a subprocess each; the rest run
one after another in a single subprocess (bad_input_batch.py), which saves importing torch ~70 times.

Entry points: `dataset/rlla_4k_raw/rlla.py`, `examples/data_preprocess/gsm8k.py` (cheap, in bulk),
`python -m verl.trainer.main_ppo` (config mistakes caught before Ray starts; a reward function returning
NaN, a string or a tuple of the wrong length fails at the first step of the smallest run),
`python -m verl.trainer.fsdp_sft_trainer` and `python -m verl.model_merger`.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pytest imports test files without their folder
from bad_input_runner import Case, Ctx, Outcome, check_case, run_batch, write  # noqa: E402

pytestmark = pytest.mark.slow

FAULT_REWARDS = str(Path(__file__).resolve().parent / "fault_rewards.py")


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """Shared valid inputs: the tiny model, an RL train parquet and an SFT parquet."""
    out = tmp_path_factory.mktemp("good")
    records = generate_records(12, seed=5)
    pd.DataFrame(records_to_rows(records, "train")).to_parquet(out / "train.parquet")
    sft_rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(8)
    ]
    pd.DataFrame(sft_rows).to_parquet(out / "sft.parquet")
    return {
        "model": tiny_model_dir,
        "train": str(out / "train.parquet"),
        "sft": str(out / "sft.parquet"),
        "actor_ckpt": _actor_checkpoint(tiny_model_dir, out / "ckpt" / "actor"),
    }


def _actor_checkpoint(model_dir: str, out: Path) -> str:
    """A real one-rank FSDP checkpoint folder of the tiny model (shards + huggingface/ config and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.checkpoint import FSDPCheckpointManager

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    FSDPCheckpointManager(model, processing_class=AutoTokenizer.from_pretrained(model_dir)).save_checkpoint(str(out))
    return str(out)


# ------------------------------------------------------------------------------------------ the corpus
def _rlla(content: str | None) -> Callable[[Ctx], list[str]]:
    def args(ctx: Ctx) -> list[str]:
        path = ctx.inp / "raw.json"
        if content is not None:
            write(path, content)
        return ["--input", str(path), "--local_dir", str(ctx.prev / "data")]

    return args


GOOD_RECORD = {"instruction": "use tools", "input": "hi", "output": "<think>x</think>"}


def _gsm8k(train: str | None, test: str | None = '{"question": "q", "answer": "#### 1"}\n', extra=()):
    def args(ctx: Ctx) -> list[str]:
        if train is not None:
            write(ctx.inp / "train.jsonl", train)
        if test is not None:
            write(ctx.inp / "test.jsonl", test)
        return ["--input_dir", str(ctx.inp), "--local_dir", str(ctx.prev / "data"), *extra]

    return args


GOOD_LINE = '{"question": "1+1?", "answer": "so #### 2"}\n'

SCRIPT_CASES = [
    Case("rlla-missing-file", "rlla", _rlla(None), ["raw.json", "does not exist", "nothing written"], isolated=True),
    Case("rlla-not-json", "rlla", _rlla("{not json"), ["raw.json", "not valid JSON"]),
    Case("rlla-empty-file", "rlla", _rlla(""), ["raw.json", "not valid JSON"]),
    Case("rlla-object-not-list", "rlla", _rlla(json.dumps(GOOD_RECORD)), ["must hold a JSON list", "got a JSON dict"]),
    Case("rlla-record-not-object", "rlla", _rlla(json.dumps([GOOD_RECORD, "text"])), ["record 1", "is a str"]),
    Case(
        "rlla-missing-key",
        "rlla",
        _rlla(json.dumps([GOOD_RECORD, {"instruction": "a", "input": "b"}])),
        ["record 1", "missing key 'output'", "'instruction', 'input', 'output'"],
    ),
    Case(
        "rlla-key-not-string",
        "rlla",
        _rlla(json.dumps([{**GOOD_RECORD, "input": 7}, GOOD_RECORD])),
        ["record 0", "'input' must be a string", "got int"],
    ),
    Case("rlla-empty-list", "rlla", _rlla("[]"), ["at least 2 records", "got 0"]),
    Case("rlla-one-record", "rlla", _rlla(json.dumps([GOOD_RECORD])), ["at least 2 records", "got 1"]),
    Case(
        "rlla-synthetic-one",
        "rlla",
        lambda ctx: ["--synthetic", "1", "--local_dir", str(ctx.prev / "data")],
        ["--synthetic must be at least 2", "got 1"],
    ),
    Case(
        "rlla-synthetic-negative",
        "rlla",
        lambda ctx: ["--synthetic", "-3", "--local_dir", str(ctx.prev / "data")],
        ["--synthetic must be at least 2", "got -3"],
    ),
    Case(
        "rlla-synthetic-not-int",
        "rlla",
        lambda ctx: ["--synthetic", "ten", "--local_dir", str(ctx.prev / "data")],
        ["--synthetic", "invalid int value", "'ten'"],
    ),
    Case("gsm8k-missing-dir", "gsm8k", _gsm8k(None, None), ["train.jsonl", "does not exist"], isolated=True),
    Case("gsm8k-missing-test", "gsm8k", _gsm8k(GOOD_LINE, None), ["test.jsonl", "does not exist"]),
    Case("gsm8k-not-json", "gsm8k", _gsm8k(GOOD_LINE + "{oops\n"), ["train.jsonl:2", "not valid JSON"]),
    Case("gsm8k-array-line", "gsm8k", _gsm8k("[1, 2]\n"), ["train.jsonl:1", "expected a JSON object", "got list"]),
    Case(
        "gsm8k-missing-answer",
        "gsm8k",
        _gsm8k('{"question": "q"}\n'),
        ["train.jsonl:1", "'answer' missing or not a string", "['question']"],
    ),
    Case("gsm8k-answer-not-string", "gsm8k", _gsm8k('{"question": "q", "answer": 3}\n'), ["'answer'", "not a string"]),
    Case("gsm8k-no-hashes", "gsm8k", _gsm8k('{"question": "q", "answer": "it is 4"}\n'), ["no '#### <number>'", "4"]),
    Case("gsm8k-empty-file", "gsm8k", _gsm8k(""), ["train.jsonl", "holds no records"]),
    Case("gsm8k-max-train-zero", "gsm8k", _gsm8k(GOOD_LINE, extra=("--max_train", "0")), ["--max_train", "got 0"]),
]


@pytest.fixture(scope="module")
def batched(good, tmp_path_factory) -> dict[str, Outcome]:
    """The outcomes of every non-isolated case, run together in one process (`run_batch`)."""
    return run_batch(ALL_CASES, good, tmp_path_factory.mktemp)


@pytest.mark.parametrize("case", SCRIPT_CASES, ids=lambda c: c.id)
def test_script_bad_input(case: Case, good, tmp_path, batched):
    check_case(case, good, tmp_path, batched)


# ------------------------------------------------------------------------------------------ main_ppo / SFT
def _ppo(*overrides: str, train: str | None = None, model: str | None = None) -> Callable[[Ctx], list[str]]:
    """main_ppo arguments for a small valid run (outputs into the earlier run's folder) plus `overrides`;
    `train`/`model` name a file/folder under the case's inputs (made by the case's setup) instead of the good one."""

    def args(ctx: Ctx) -> list[str]:
        return [
            f"data.train_files={ctx.inp / train if train else ctx.good['train']}",
            f"actor_rollout_ref.model.path={ctx.inp / model if model else ctx.good['model']}",
            "data.max_prompt_length=384",
            "data.max_response_length=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            f"trainer.default_local_dir={ctx.prev}",
            "trainer.ray_init.num_cpus=2",
            *(o.replace("{inp}", str(ctx.inp)) for o in overrides),
        ]

    return args


def _parquet(name: str, rows: list[dict] | None = None, raw: bytes | None = None) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        if raw is not None:
            (ctx.inp / name).write_bytes(raw)
        else:
            pd.DataFrame(rows).to_parquet(ctx.inp / name)

    return setup


def _model_copy(edit: Callable[[Path], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        shutil.copytree(ctx.good["model"], ctx.inp / "model")
        edit(ctx.inp / "model")

    return setup


def _bert_folder(ctx: Ctx) -> None:
    (ctx.inp / "bert").mkdir()
    config = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 8, "num_hidden_layers": 1}
    (ctx.inp / "bert" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 2}))


def _drop_chat_template(model: Path) -> None:
    for p in model.glob("chat_template.*"):
        p.unlink()
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))


def _reward_file(ctx: Ctx) -> None:
    write(
        ctx.inp / "reward.py",
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    )
    write(ctx.inp / "broken.py", "import not_a_module_anywhere\n")


CHAT = [{"role": "user", "content": "hello"}]
PPO_CASES = [
    Case("ppo-missing-train-file", "ppo", _ppo(train="nope.parquet"), ["data.train_files", "nope.parquet"]),
    Case(
        "ppo-empty-parquet",
        "ppo",
        _ppo(train="empty.parquet"),
        ["empty.parquet", "hold no rows"],
        lambda ctx: _empty_parquet(ctx),
    ),
    Case(
        "ppo-corrupt-parquet",
        "ppo",
        _ppo(train="bad.parquet"),
        ["bad.parquet"],
        _parquet("bad.parquet", raw=b"PAR1garbage"),
    ),
    Case(
        "ppo-prompt-is-string",
        "ppo",
        _ppo(train="str.parquet"),
        ["str.parquet", "row 0", "non-empty list of chat messages", "got str"],
        _parquet("str.parquet", [{"prompt": "just text", "data_source": "rlla"}]),
    ),
    Case(
        "ppo-prompt-empty-list",
        "ppo",
        _ppo(train="emptyprompt.parquet"),
        ["emptyprompt.parquet", "row 1", "non-empty list of chat messages"],
        _parquet("emptyprompt.parquet", [{"prompt": CHAT}, {"prompt": []}]),
    ),
    Case(
        "ppo-prompt-not-messages",
        "ppo",
        _ppo(train="ints.parquet"),
        ["ints.parquet", "row 0", "prompt message 0", "'role'"],
        _parquet("ints.parquet", [{"prompt": [{"text": "hi"}]}]),
    ),
    Case(
        "ppo-no-prompt-column",
        "ppo",
        _ppo("data.prompt_key=question"),
        ["no prompt column 'question'", "data.prompt_key"],
    ),
    Case(
        "ppo-all-prompts-too-long",
        "ppo",
        _ppo("data.max_prompt_length=4"),
        ["longer than max_prompt_length=4", "raise data.max_prompt_length"],
    ),
    Case("ppo-bad-truncation", "ppo", _ppo("data.truncation=wrap"), ["data.truncation='wrap'", "error", "middle"]),
    Case(
        "ppo-unknown-estimator", "ppo", _ppo("algorithm.adv_estimator=magic"), ["magic", "grpo", "gae"], isolated=True
    ),
    Case(
        "ppo-unknown-policy-loss",
        "ppo",
        _ppo("actor_rollout_ref.actor.policy_loss.loss_mode=nope"),
        ["nope", "vanilla"],
    ),
    Case("ppo-unknown-reward-manager", "ppo", _ppo("reward_model.reward_manager=fancy"), ["'fancy'", "naive"]),
    Case("ppo-unknown-rollout", "ppo", _ppo("actor_rollout_ref.rollout.name=tgi"), ["'tgi'", "hf"]),
    Case(
        "ppo-engine-without-fallback",
        "ppo",
        _ppo("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.engine_fallback=false"),
        ["rollout.name=sglang", "engine_fallback=true"],
    ),
    Case(
        "ppo-batch-not-divisible",
        "ppo",
        _ppo("actor_rollout_ref.actor.ppo_mini_batch_size=3"),
        ["data.train_batch_size=4", "ppo_mini_batch_size=3", "divisible"],
    ),
    Case("ppo-zero-batch", "ppo", _ppo("data.train_batch_size=0"), ["data.train_batch_size", "positive", "got 0"]),
    Case("ppo-negative-n", "ppo", _ppo("actor_rollout_ref.rollout.n=-2"), ["rollout.n=-2", "at least one"]),
    Case("ppo-model-missing", "ppo", _ppo(model="no_model"), ["model.path", "no_model", "no such folder"]),
    Case(
        "ppo-model-empty-folder",
        "ppo",
        _ppo(model="empty"),
        ["empty", "config.json"],
        lambda ctx: (ctx.inp / "empty").mkdir(),
    ),
    Case("ppo-model-is-bert", "ppo", _ppo(model="bert"), ["'bert'", "not a causal LM"], _bert_folder),
    Case(
        "ppo-no-chat-template",
        "ppo",
        _ppo(model="model"),
        ["no chat template", "chat_template"],
        _model_copy(_drop_chat_template),
    ),
    Case(
        "ppo-reward-file-missing",
        "ppo",
        _ppo("custom_reward_function.path={inp}/missing_reward.py"),
        ["custom_reward_function.path", "missing_reward.py", "not a file"],
    ),
    Case(
        "ppo-reward-file-broken",
        "ppo",
        _ppo("custom_reward_function.path={inp}/broken.py"),
        ["broken.py", "failed to import", "not_a_module_anywhere"],
        _reward_file,
    ),
    Case(
        "ppo-reward-fn-missing",
        "ppo",
        _ppo("custom_reward_function.path={inp}/reward.py", "custom_reward_function.name=score"),
        ["custom_reward_function.name='score'", "my_score"],
        _reward_file,
    ),
]


def _empty_parquet(ctx: Ctx) -> None:
    pd.DataFrame({"prompt": pd.Series([], dtype=object)}).to_parquet(ctx.inp / "empty.parquet")


@pytest.mark.parametrize("case", PPO_CASES, ids=lambda c: c.id)
def test_main_ppo_bad_input(case: Case, good, tmp_path, batched):
    check_case(case, good, tmp_path, batched)


# ------------------------------------------------------------------------------------------ more main_ppo cases
def _tokenizer_without_pad_or_eos(model: Path) -> None:
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = cfg["eos_token"] = None
    cfg_path.write_text(json.dumps(cfg))


def _rows(edit: Callable[[dict], None]) -> list[dict]:
    rows = records_to_rows(generate_records(6, seed=5), "train")
    for row in rows:
        edit(row)
    return rows


def _incomplete_checkpoint(ctx: Ctx) -> None:
    folder = ctx.inp / "global_step_3"
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"half written")


def _domains(probs: str) -> Callable[[Ctx], list[str]]:
    def args(ctx: Ctx) -> list[str]:
        train = ctx.good["train"]
        domains = f"{{a: {{train_files: [{train}], reward: rlla}}, b: {{train_files: [{train}], reward: rlla}}}}"
        base = _ppo(f"data.domains={domains}", f"data.domain_interleave_probs={probs}")(ctx)
        return [a for a in base if not a.startswith("data.train_files=")] + ["data.train_files=null"]

    return args


def _smallest_run(reward_fn: str) -> Callable[[Ctx], list[str]]:
    """One step of 2 prompts x 2 samples of 8 tokens scored by `fault_rewards.<reward_fn>` (it fails on row 0)."""
    return _ppo(
        "data.train_batch_size=2",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "trainer.ray_init.num_cpus=1",
        f"custom_reward_function.path={FAULT_REWARDS}",
        f"custom_reward_function.name={reward_fn}",
    )


MORE_PPO_CASES = [
    Case(
        "ppo-tokenizer-without-pad-or-eos",
        "ppo",
        _ppo(model="model"),
        ["neither a pad token nor an eos token", "pad_token"],
        _model_copy(_tokenizer_without_pad_or_eos),
    ),
    Case(
        "ppo-resume-path-missing",
        "ppo",
        _ppo("trainer.resume_mode=resume_path", "trainer.resume_from_path={inp}/nowhere"),
        ["trainer.resume_from_path=", "nowhere", "holds no complete checkpoint", "resume_mode=auto or disable"],
    ),
    Case(
        "ppo-resume-path-incomplete",
        "ppo",
        _ppo("trainer.resume_mode=resume_path", "trainer.resume_from_path={inp}/global_step_3"),
        ["global_step_3", "holds no complete checkpoint", "COMPLETE"],
        _incomplete_checkpoint,
    ),
    Case(
        "ppo-resume-path-unset",
        "ppo",
        _ppo("trainer.resume_mode=resume_path"),
        ["trainer.resume_from_path=None", "holds no complete checkpoint"],
    ),
    Case(
        "ppo-overlong-truncation-error-unfiltered",
        "ppo",
        _ppo("data.max_prompt_length=40", "data.filter_overlong_prompts=false"),
        ["row 0", "more than data.max_prompt_length=40 with data.truncation=error", "filter_overlong_prompts=true"],
    ),
    *[
        Case(
            f"ppo-overlong-truncation-{mode}-all-filtered",
            "ppo",
            _ppo(f"data.truncation={mode}", "data.filter_overlong_prompts=true", "data.max_prompt_length=4"),
            ["every prompt", "longer than max_prompt_length=4", "raise data.max_prompt_length"],
        )
        for mode in ("left", "right", "middle")
    ],
    Case(
        "ppo-unknown-data-source",
        "ppo",
        _ppo(train="mystery.parquet"),
        ["mystery.parquet", "row 0", "data_source='mystery'", "no built-in reward function", "rlla"],
        _parquet("mystery.parquet", _rows(lambda row: row.update(data_source="mystery"))),
    ),
    Case(
        "ppo-reward-model-column-not-dict",
        "ppo",
        _ppo(train="gt.parquet"),
        ["gt.parquet", "row 0", "reward_model=", "must be a dict with a 'ground_truth'"],
        _parquet("gt.parquet", _rows(lambda row: row.update(reward_model="42"))),
    ),
    Case(
        "ppo-reward-timeout-negative",
        "ppo",
        _ppo("reward_model.timeout_s=-1"),
        ["reward_model.timeout_s=-1", "null (no limit) or seconds > 0"],
    ),
    Case(
        "ppo-domain-probs-not-summing-to-1",
        "ppo",
        _domains("{a: 0.5, b: 0.3}"),
        ["data.domain_interleave_probs must sum to 1", "0.8"],
    ),
    Case(
        "ppo-reward-returns-nan",
        "ppo",
        _smallest_run("nan_score"),
        ["RewardFunctionError", "nan_score on row 0", "non-finite score nan"],
        isolated=True,
    ),
    Case(
        "ppo-reward-returns-string",
        "ppo",
        _smallest_run("string_score"),
        ["RewardFunctionError", "string_score on row 0", "returned score '1.0' of type str; expected a real number"],
        isolated=True,
    ),
    Case(
        "ppo-reward-returns-short-tuple",
        "ppo",
        _smallest_run("short_tuple"),
        ["RewardFunctionError", "short_tuple on row 0", "tuple of length 2", "(score, format, correctness, length)"],
        isolated=True,
    ),
]


@pytest.mark.parametrize("case", MORE_PPO_CASES, ids=lambda c: c.id)
def test_main_ppo_more_bad_input(case: Case, good, tmp_path, batched):
    check_case(case, good, tmp_path, batched)


# ------------------------------------------------------------------------------------------ model_merger
def _merger(local: str | None = None, *extra: str, target: str = "{prev}/merged") -> Callable[[Ctx], list[str]]:
    """model_merger arguments: `local` under the case's inputs (default: the good checkpoint), output inside the
    earlier run's folder (so any file it wrote would show)."""

    def args(ctx: Ctx) -> list[str]:
        local_dir = str(ctx.inp / local) if local else ctx.good["actor_ckpt"]
        out = target.replace("{prev}", str(ctx.prev))
        return ["--local_dir", local_dir, "--target_dir", out, *(e.replace("{inp}", str(ctx.inp)) for e in extra)]

    return args


def _ckpt_copy(edit: Callable[[Path], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        shutil.copytree(ctx.good["actor_ckpt"], ctx.inp / "ckpt")
        edit(ctx.inp / "ckpt")

    return setup


MERGER_CASES = [
    Case("merger-missing-dir", "merger", _merger("nope"), ["nope", "does not exist"], isolated=True),
    Case(
        "merger-no-shards",
        "merger",
        _merger("empty"),
        ["no model_world_size_*_rank_*.pt", "found: nothing"],
        lambda ctx: (ctx.inp / "empty").mkdir(),
    ),
    Case(
        "merger-corrupt-shard",
        "merger",
        _merger("ckpt"),
        ["cannot read shard", "model_world_size_1_rank_0.pt"],
        _ckpt_copy(lambda d: (d / "model_world_size_1_rank_0.pt").write_bytes(b"PK\x03\x04 truncated")),
    ),
    Case(
        "merger-missing-rank",
        "merger",
        _merger("ckpt"),
        ["world size 2", "lack ranks [1]"],
        _ckpt_copy(lambda d: (d / "model_world_size_1_rank_0.pt").rename(d / "model_world_size_2_rank_0.pt")),
    ),
    Case(
        "merger-no-config",
        "merger",
        _merger("ckpt"),
        ["no config.json", "--hf_model_path"],
        _ckpt_copy(lambda d: shutil.rmtree(d / "huggingface")),
    ),
    Case(
        "merger-config-of-another-model",
        "merger",
        _merger(None, "--hf_model_path", "{inp}/bert"),
        ["does not match the model config", "missing"],
        _bert_folder,
    ),
    Case(
        "merger-target-not-empty",
        "merger",
        _merger(target="{prev}/grpo_tiny/global_step_1"),
        ["global_step_1", "is not empty", "--overwrite"],
    ),
    Case(
        "merger-unknown-backend",
        "merger",
        _merger(None, "--backend", "megatron"),
        ["--backend", "invalid choice: 'megatron'", "fsdp"],
    ),
]


@pytest.mark.parametrize("case", MERGER_CASES, ids=lambda c: c.id)
def test_model_merger_bad_input(case: Case, good, tmp_path, batched):
    check_case(case, good, tmp_path, batched)


# ------------------------------------------------------------------------------------------ the SFT trainer
def _sft(*overrides: str, train: str | None = None) -> Callable[[Ctx], list[str]]:
    """fsdp_sft_trainer arguments for a small valid run into the earlier run's folder, plus `overrides`."""

    def args(ctx: Ctx) -> list[str]:
        return [
            f"data.train_files={ctx.inp / train if train else ctx.good['sft']}",
            f"model.partial_pretrain={ctx.good['model']}",
            "data.max_length=64",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={ctx.prev}/sft",
            *(o.replace("{inp}", str(ctx.inp)) for o in overrides),
        ]

    return args


SFT_CASES = [
    Case("sft-missing-train-file", "sft", _sft(train="nope.parquet"), ["nope.parquet", "does not exist"]),
    Case(
        "sft-messages-not-chat",
        "sft",
        _sft(train="text.parquet"),
        ["text.parquet", "row 0"],
        _parquet("text.parquet", [{"messages": "just a string"}] * 4),
    ),
    Case(
        "sft-no-assistant-turn",
        "sft",
        _sft(train="user.parquet"),
        ["user.parquet", "no assistant message"],
        _parquet("user.parquet", [{"messages": [{"role": "user", "content": "hi"}]}] * 4),
    ),
    Case(
        "sft-bad-dtype",
        "sft",
        _sft("model.dtype=float64"),
        ["model.dtype='float64'", "allowed", "bfloat16"],
        isolated=True,
    ),
    Case(
        "sft-batch-not-divisible",
        "sft",
        _sft("data.train_batch_size=6", "data.micro_batch_size_per_gpu=4"),
        ["train_batch_size/world_size=6", "micro_batch_size_per_gpu=4", "divisible"],
    ),
    Case("sft-bad-truncation", "sft", _sft("data.truncation=middle"), ["data.truncation='middle'", "allowed"]),
    Case("sft-bad-pad-mode", "sft", _sft("data.pad_mode=left"), ["data.pad_mode='left'", "allowed", "no_padding"]),
    Case("sft-model-missing", "sft", _sft("model.partial_pretrain={inp}/no_model"), ["no_model"]),
]


@pytest.mark.parametrize("case", SFT_CASES, ids=lambda c: c.id)
def test_sft_trainer_bad_input(case: Case, good, tmp_path, batched):
    check_case(case, good, tmp_path, batched)


ALL_CASES = SCRIPT_CASES + PPO_CASES + MORE_PPO_CASES + MERGER_CASES + SFT_CASES
assert len({c.id for c in ALL_CASES}) == len(ALL_CASES), "case ids must be unique"
