"""The start-up choice of the rollout engine (verl/workers/rollout/__init__.py `resolve_rollout_engine`) and the
driver check that writes it into the config (verl/trainer/main_ppo.py `_check_rollout_name`).

No GPU and no vllm/sglang are needed: "installed" and "has a GPU" are simulated by patching `find_spec` and by the
`cuda_available` argument.
"""

import importlib.util
import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl
from verl.workers import rollout as rollout_pkg
from verl.workers.rollout import resolve_rollout_engine

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def cfg(**keys):
    return OmegaConf.create({"name": "hf", **keys})


@pytest.fixture
def installed(monkeypatch):
    """Make `find_spec` report vllm and sglang as installed."""
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return object() if name in ("vllm", "sglang") else real(name, *args, **kwargs)

    monkeypatch.setattr(rollout_pkg.importlib.util, "find_spec", fake)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.skipif(bool(importlib.util.find_spec("vllm")), reason="checks a machine without vllm")
def test_missing_engine_falls_back_to_hf_with_one_notice(engine):
    if importlib.util.find_spec(engine):
        pytest.skip(f"{engine} is installed here")
    updates, notices = resolve_rollout_engine(cfg(name=engine), "auto", cuda_available=True)
    assert updates == {"name": "hf"}
    assert notices == [
        f"notice: actor_rollout_ref.rollout.name={engine} but {engine} is not installed: using the hf engine; "
        "set actor_rollout_ref.rollout.engine_fallback=false to make this an error"
    ]
    with pytest.raises(ValueError, match=rf"rollout.name={engine} but {engine} is not installed; .*rollout.name=hf"):
        resolve_rollout_engine(cfg(name=engine, engine_fallback=False), "auto", cuda_available=True)


def test_installed_engine_without_gpu_or_on_cpu_device_falls_back(installed):
    updates, notices = resolve_rollout_engine(cfg(name="vllm"), "auto", cuda_available=False)
    assert updates == {"name": "hf"} and "but no CUDA GPU is visible: using the hf engine" in notices[0]
    updates, notices = resolve_rollout_engine(cfg(name="sglang"), "cpu", cuda_available=True)
    assert updates == {"name": "hf"} and "sglang but trainer.device=cpu" in notices[0] and len(notices) == 1
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        resolve_rollout_engine(cfg(name="vllm", engine_fallback=False), "auto", cuda_available=False)


def test_installed_engine_on_gpu_runs_and_tensor_parallel_is_one_per_rank(installed):
    assert resolve_rollout_engine(cfg(name="vllm", tensor_model_parallel_size=1), "cuda", True) == (
        {"name": "vllm"},
        [],
    )
    updates, notices = resolve_rollout_engine(cfg(name="sglang", tensor_model_parallel_size=2), "auto", True)
    assert updates == {"name": "sglang", "tensor_model_parallel_size": 1}
    assert len(notices) == 1 and "tensor_model_parallel_size=2 (verl's default)" in notices[0]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4: .*one vllm engine per rank"):
        resolve_rollout_engine(cfg(name="vllm", tensor_model_parallel_size=4), "cuda", True)


def test_hf_names_gpu_engine_keys_that_have_no_effect():
    defaults = cfg(gpu_memory_utilization=0.5, tensor_model_parallel_size=2, max_num_seqs=256, load_format="dummy")
    assert resolve_rollout_engine(defaults, "cpu", False) == ({"name": "hf"}, [])
    assert resolve_rollout_engine(cfg(tensor_model_parallel_size=1), "cpu", False) == ({"name": "hf"}, [])
    changed = cfg(gpu_memory_utilization=0.8, tensor_model_parallel_size=4, engine_kwargs={"vllm": {"a": 1}})
    _, notices = resolve_rollout_engine(changed, "cpu", False)
    assert notices == [
        "notice: actor_rollout_ref.rollout.{gpu_memory_utilization=0.8, tensor_model_parallel_size=4, "
        "engine_kwargs.vllm} configure the vllm/sglang engines and have no effect on the hf engine (one un-sharded "
        "copy of the policy per rank)"
    ]


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'trtllm'.*\['hf', 'sglang', 'vllm'\]"):
        resolve_rollout_engine(cfg(name="trtllm"), "cpu", False)


def test_driver_check_writes_the_engine_into_the_config(capsys):
    """Hydra's force-add `++` reaches the key whether or not the YAML has it; the driver prints one line."""
    from verl.trainer.main_ppo import _check_rollout_name

    if importlib.util.find_spec("vllm") and __import__("torch").cuda.is_available():
        pytest.skip("vllm runs here")
    overrides = ["actor_rollout_ref.model.path=/nonexistent", "actor_rollout_ref.rollout.name=vllm",
                 "++actor_rollout_ref.rollout.engine_fallback=true", "++actor_rollout_ref.rollout.multi_turn.format=hermes",
                 "actor_rollout_ref.rollout.workflow=multi_turn_tool"]  # fmt: skip
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
        _check_rollout_name(config)
        assert config.actor_rollout_ref.rollout.name == "hf"
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("notice: actor_rollout_ref.rollout.name=vllm but ")
        bad = compose(
            config_name="ppo_trainer", overrides=[*overrides[:4], "++actor_rollout_ref.rollout.multi_turn.format=gpt"]
        )
        bad.actor_rollout_ref.rollout.workflow = "multi_turn_tool"
        with pytest.raises(
            ValueError, match=r"multi_turn.format='gpt' is not a known tool-call format; known: \['hermes'\]"
        ):
            _check_rollout_name(bad)


@pytest.mark.skipif(bool(importlib.util.find_spec("vllm")), reason="checks a machine without vllm")
def test_engine_fallback_false_exits_with_one_line(tiny_model_dir, tmp_path):
    """Through the real entry point: a ValueError at start-up, before Ray, is one line and exit code 1."""
    from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

    pd.DataFrame(records_to_rows(generate_records(4, seed=0), "train")).to_parquet(tmp_path / "train.parquet")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"data.train_files={tmp_path}/train.parquet",
         f"data.val_files={tmp_path}/train.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}",
         "actor_rollout_ref.rollout.name=vllm", "++actor_rollout_ref.rollout.engine_fallback=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "error: ValueError: actor_rollout_ref.rollout.name=vllm but vllm is not installed; run on a CUDA machine with vllm "
        "installed, use actor_rollout_ref.rollout.name=hf, or set actor_rollout_ref.rollout.engine_fallback=true"
    ], proc.stderr[-3000:]
