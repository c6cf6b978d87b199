"""Tests for verl.model_merger: FSDP2 checkpoint shards -> HF folder that reloads with the same weights and tokens."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM

from tests.multirank import run_ranks
from verl.model_merger import main, merge_shards
from verl.models.tiny import random_qwen2
from verl.utils.checkpoint import FSDPCheckpointManager
from verl.utils.fsdp_utils import (
    apply_fsdp2,
    destroy_distributed,
    free_port,
    get_full_state_dict,
    init_distributed,
    load_causal_lm,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def word_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<pad>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


def sgd_step(model: torch.nn.Module, vocab_size: int, seed: int = 0) -> None:
    """One training step so that the saved weights differ from the base model's."""
    ids = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.5)
            p.grad = None


def run_merger(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "verl.model_merger", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)


def greedy(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    prompt = torch.arange(3, 3 + 10).remainder(vocab_size).view(2, 5)
    with torch.no_grad():
        return model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )


def assert_same_weights(merged: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = merged.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------- merge_shards against hand-made shards
def test_merge_shards_concatenates_uneven_dim0_and_keeps_replicated():
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    bias = torch.tensor([1.0, 2.0])
    shards = [{"w": weight[:3], "b": bias}, {"w": weight[3:], "b": bias}]
    merged = merge_shards(shards, {"w": torch.Size([5, 3]), "b": torch.Size([2])})
    assert torch.equal(merged["w"], weight) and torch.equal(merged["b"], bias)
    # one row over 2 ranks: rank 1 holds an empty shard
    merged = merge_shards([{"w": weight[:1]}, {"w": weight[:0]}], {"w": torch.Size([1, 3])})
    assert torch.equal(merged["w"], weight[:1])


def test_merge_shards_rejects_shapes_that_do_not_add_up():
    shards = [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)}]
    with pytest.raises(Exception, match=r"cannot merge 'w': rank shapes \[\(2, 3\), \(2, 3\)\].*\(5, 3\)"):
        merge_shards(shards, {"w": torch.Size([5, 3])})
    with pytest.raises(Exception, match=r"missing \['v'\]"):
        merge_shards([{"w": torch.zeros(5, 3)}], {"w": torch.Size([5, 3]), "v": torch.Size([1])})


# ---------------------------------------------------------------- one rank, end to end through the CLI
def test_merge_one_rank_checkpoint_with_huggingface_folder(tmp_path, process_group, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab_size = model.config.vocab_size
    apply_fsdp2(model)
    sgd_step(model, vocab_size)
    ckpt = tmp_path / "ckpt" / "actor"
    FSDPCheckpointManager(model, processing_class=tokenizer).save_checkpoint(str(ckpt))
    assert sorted(os.listdir(ckpt / "huggingface")).count("config.json") == 1
    assert not any(f.endswith(".safetensors") for f in os.listdir(ckpt / "huggingface"))

    out = tmp_path / "merged"
    result = run_merger("--local_dir", str(ckpt), "--target_dir", str(out))
    assert result.returncode == 0, result.stderr
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert_same_weights(merged, get_full_state_dict(model))
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # tied in the tiny model
    assert torch.equal(greedy(merged, vocab_size), greedy(model, vocab_size))
    text = "Hello, world! 12+7=19"
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p or ".old" in p]

    # an existing non-empty target is kept unless --overwrite
    result = run_merger("merge", "--backend", "fsdp", "--local_dir", str(ckpt), "--target_dir", str(out))
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "--overwrite" in result.stderr
    (out / "marker").write_text("old")
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), "--overwrite"]) == 0
    assert not (out / "marker").exists()
    assert_same_weights(AutoModelForCausalLM.from_pretrained(str(out)), get_full_state_dict(model))


def test_merge_with_hf_model_path_when_checkpoint_has_no_config(tmp_path, process_group):
    base = tmp_path / "base"
    random_qwen2().save_pretrained(str(base))
    word_tokenizer().save_pretrained(str(base))
    model = apply_fsdp2(random_qwen2())
    sgd_step(model, 100)
    ckpt = tmp_path / "ckpt"
    FSDPCheckpointManager(model).save_checkpoint(str(ckpt))  # no tokenizer: no huggingface/ folder

    out = tmp_path / "merged"
    assert main(["--local_dir", str(ckpt), "--target_dir", str(out)]) == 1  # no config anywhere
    assert not out.exists()
    assert main(["merge", "--backend", "fsdp", "--local_dir", str(ckpt), "--target_dir", str(out),
                 "--hf_model_path", str(base)]) == 0  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert_same_weights(merged, get_full_state_dict(model))
    assert not torch.equal(merged.lm_head.weight, random_qwen2().lm_head.weight)  # trained, not the base weights
    assert torch.equal(greedy(merged, 100), greedy(model, 100))
    assert PreTrainedTokenizerFast.from_pretrained(str(out))("hello world")["input_ids"] == [2, 3]


# ---------------------------------------------------------------- errors: one line, exit 1, nothing written
def error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_errors_name_the_path_and_what_was_found(tmp_path, capsys):
    out = tmp_path / "out"
    missing = tmp_path / "nope"
    assert str(missing) in error_line(capsys, ["--local_dir", str(missing), "--target_dir", str(out)])

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("x")
    err = error_line(capsys, ["--local_dir", str(ckpt), "--target_dir", str(out)])
    assert "no model_world_size_*_rank_*.pt" in err and "notes.txt" in err

    (ckpt / "model_world_size_2_rank_0.pt").write_bytes(b"")
    err = error_line(capsys, ["--local_dir", str(ckpt), "--target_dir", str(out)])
    assert "world size 2 lack ranks [1]" in err and "model_world_size_2_rank_0.pt" in err

    (ckpt / "model_world_size_1_rank_0.pt").write_bytes(b"")
    err = error_line(capsys, ["--local_dir", str(ckpt), "--target_dir", str(out)])
    assert "mix world sizes [1, 2]" in err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_cli_error_exit_code_and_stderr(tmp_path):
    result = run_merger("--local_dir", str(tmp_path / "nope"), "--target_dir", str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and str(tmp_path / "nope") in result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- two ranks
def _two_rank_save_worker(rank: int, world_size: int, port: int, ckpt_dir: str, full_path: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    init_distributed("gloo")
    model = apply_fsdp2(random_qwen2())
    sgd_step(model, 100, seed=rank)
    FSDPCheckpointManager(model).save_checkpoint(ckpt_dir)
    full = get_full_state_dict(model)
    if rank == 0:
        torch.save(full, full_path)
    destroy_distributed()
    # leave without the interpreter's teardown: gloo's threads still holding tensors then can abort the process
    # (SIGABRT, "terminate called without an active exception") after all of its work was done and saved
    os._exit(0)


@pytest.mark.slow  # 2 ranks (tests/multirank.py), then the merger subprocess
def test_merge_two_rank_checkpoint(tmp_path):
    ckpt, full_path = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_two_rank_save_worker, 2, free_port(), ckpt, full_path)
    shards = [torch.load(os.path.join(ckpt, f"model_world_size_2_rank_{r}.pt")) for r in range(2)]
    assert [s["model.layers.0.mlp.gate_proj.weight"].shape[0] for s in shards] == [23, 22]
    base = tmp_path / "base"
    random_qwen2().save_pretrained(str(base))
    word_tokenizer().save_pretrained(str(base))

    out = tmp_path / "merged"
    result = run_merger("--local_dir", ckpt, "--target_dir", str(out), "--hf_model_path", str(base))
    assert result.returncode == 0, result.stderr
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    full = torch.load(full_path)
    assert_same_weights(merged, full)
    reference = Qwen2ForCausalLM(merged.config)
    reference.load_state_dict(full)
    assert torch.equal(greedy(merged, 100), greedy(reference, 100))

    os.remove(os.path.join(ckpt, "model_world_size_2_rank_1.pt"))
    result = run_merger("--local_dir", ckpt, "--target_dir", str(tmp_path / "again"), "--hf_model_path", str(base))
    assert result.returncode == 1 and "lack ranks [1]" in result.stderr and not (tmp_path / "again").exists()
