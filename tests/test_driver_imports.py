"""What the Ray driver holds in memory: `main_ppo`'s driver imports the worker classes, the trainer, the dataset
and the reward code, but not the workers' training stack (FSDP2, DTensor, torch.distributed.checkpoint, HF's model
code, the rollout engines), not torch._dynamo (tensordict's torch.compile marks wait for it:
`verl.utils.tensordict_import`), not pyarrow's dataset layer with pandas, and not matplotlib; each would stay
resident in the driver for the whole run (~110, ~90, ~50 and ~20 MB). Run in a fresh interpreter, since the test
session imports all of them. Also: the deferred marks are applied, on the same function objects, once
torch._dynamo loads, and torch.compile runs through TensorDict code."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

HEAVY = (
    "torch._dynamo",
    "sympy",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "transformers.modeling_utils",
    "verl.workers.rollout.hf_rollout",
    "verl.workers.engine",
    "pandas",
    "pyarrow.dataset",
    "matplotlib",
)

DRIVER = """
import json, sys
from omegaconf import OmegaConf
import verl.trainer.main_ppo
from verl.single_controller import RayWorkerGroup
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.reward import load_reward_manager
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer import hf_tokenizer
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from verl.workers.rollout import resolve_rollout_engine
model_dir, data = sys.argv[1], sys.argv[2]
tokenizer = hf_tokenizer(model_dir)
dataset = RLHFDataset([data], tokenizer, OmegaConf.create({"max_prompt_length": 64}))
resolve_rollout_engine(OmegaConf.create({"name": "hf"}), "cpu")
heavy = [m for m in json.loads(sys.argv[3]) if m in sys.modules]
print(json.dumps({"rows": len(dataset), "heavy": heavy}))
"""

MARKS = """
import json, sys
import verl
import tensordict.base, tensordict.utils
before = "torch._dynamo" in sys.modules
import torch, torch._dynamo
from torch._dynamo import trace_rules
from tensordict import TensorDict
allowed = id(tensordict.base._foreach_copy_compiled) in trace_rules._allowed_callable_ids
constant = getattr(tensordict.utils._lock_warn, "_dynamo_marked_constant", False)
td = TensorDict({"a": torch.ones(3), "b": torch.arange(3.0)}, batch_size=[3])
compiled = torch.compile(lambda t: (t["a"] * 2 + t["b"]).sum(), backend="eager")(td)
print(json.dumps({"dynamo_before": before, "allowed": allowed, "constant": constant, "value": float(compiled)}))
"""


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_driver_imports_no_training_stack(tiny_model_dir, tmp_path):
    data = tmp_path / "train.parquet"
    prompts = [[{"role": "user", "content": f"what is {i} + {i}?"}] for i in range(3)]
    pq.write_table(pa.table({"prompt": prompts, "data_source": ["openai/gsm8k"] * 3}), data)
    out = _run(DRIVER, tiny_model_dir, str(data), json.dumps(HEAVY))
    assert out["rows"] == 3
    assert out["heavy"] == []


def test_tensordict_marks_wait_for_dynamo_and_compile_still_runs():
    out = _run(MARKS)
    assert out == {"dynamo_before": False, "allowed": True, "constant": True, "value": 9.0}
