"""Entry point: `python -m verl.trainer.main_ppo key=value ...` (Hydra, config ppo_trainer.yaml).

Builds the tokenizer, datasets, reward managers, role -> worker mapping and resource pools, starts
(or joins, with RAY_ADDRESS) Ray, and runs `RayPPOTrainer.fit`. Configuration mistakes end with one
line on stderr naming the bad value and a non-zero exit code; Ctrl-C stops the workers and Ray.

Layer 8.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError, OmegaConfBaseException)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={name!r}; allowed: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
    return name


def _check_paths(config: DictConfig) -> None:
    files = config.data.train_files
    for f in [files] if isinstance(files, str) else list(files):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.train_files: no such file {f!r}")
    model_path = config.actor_rollout_ref.model.path
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path!r} is not a directory (an HF model folder is needed; "
            f"nothing is downloaded)"
        )
    _check_model_is_causal_lm(model_path)
    _check_rollout_name(config.actor_rollout_ref.rollout.name)
    _check_custom_reward(config)


def _check_model_is_causal_lm(model_path: str) -> None:
    """The model folder must hold an HF config of a causal LM (checked before Ray and the workers start)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path!r} has no config.json (an HF model folder is needed)"
        )
    hf_config = AutoConfig.from_pretrained(model_path)
    model_type = hf_config.model_type
    architectures = list(getattr(hf_config, "architectures", None) or [])
    # an architecture list naming no LM head (e.g. BertModel) is an encoder checkpoint, even if the type has one
    headless = architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or headless:
        raise ValueError(
            f"actor_rollout_ref.model.path={model_path!r} is a {model_type!r} model, not a causal LM "
            f"(AutoModelForCausalLM supports e.g. qwen2, llama, gpt2)"
        )


def _check_rollout_name(name: str) -> None:
    from verl.workers.rollout import get_rollout_class

    get_rollout_class(name)  # unknown name -> ValueError listing the known engines


def _check_custom_reward(config: DictConfig) -> None:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    try:
        get_custom_reward_fn(config)
    except (AttributeError, TypeError) as err:  # a missing or non-callable function name
        raise ValueError(str(err)) from err


def init_ray(config: DictConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env_vars})
    else:
        num_cpus = config.trainer.get("ray_init", {}).get("num_cpus")
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env={"env_vars": env_vars},
            log_to_driver=True,
            configure_logging=True,
            logging_level="WARNING",
        )


def build_trainer(config: DictConfig):
    """Everything `run_ppo` does before `fit()`: returns the trainer with its workers started."""
    import ray
    import torch

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager, Role
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    _check_paths(config)
    device = resolve_device(config.trainer.device)
    with open_dict(config):
        config.actor_rollout_ref.device = device
        config.critic.device = device
    torch.manual_seed(config.trainer.seed)
    tokenizer = hf_tokenizer(
        config.data.tokenizer or config.actor_rollout_ref.model.path,
        trust_remote_code=config.actor_rollout_ref.model.trust_remote_code,
    )
    train_dataset = RLHFDataset(config.data.train_files, tokenizer, config.data)
    val_dataset = RLHFDataset(config.data.val_files, tokenizer, config.data) if config.data.val_files else None
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
    val_reward_fn = load_reward_manager(config, tokenizer, num_examine=config.reward_model.get("num_examine", 1))

    n_proc = int(config.trainer.n_gpus_per_node)
    nnodes = int(config.trainer.nnodes)
    pool_manager = ResourcePoolManager(
        resource_pool_spec={"global_pool": [n_proc] * nnodes},
        mapping={Role.ActorRollout: "global_pool", Role.Critic: "global_pool"},
        use_gpu=device == "cuda",
    )
    # the trainer checks the whole config before Ray starts, so mistakes fail in seconds
    trainer = RayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping={Role.ActorRollout: ActorRolloutRefWorker, Role.Critic: CriticWorker},
        resource_pool_manager=pool_manager,
        reward_fn=reward_fn,
        val_reward_fn=val_reward_fn,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        collate_fn=collate_fn,
    )
    init_ray(config)
    cpus_per_worker = config.trainer.get("cpus_per_worker")
    if cpus_per_worker is None:
        cpus_per_worker = max(1, int(ray.cluster_resources().get("CPU", 1)) // (n_proc * nnodes))
    pool_manager.cpus_per_process = int(cpus_per_worker)
    trainer.init_workers()
    return trainer


def run_ppo(config: DictConfig) -> dict:
    """Run one training job in this process (starts Ray if needed, shuts it down at the end)."""
    import ray

    started_here = not ray.is_initialized()
    try:
        trainer = build_trainer(config)
        return trainer.fit()
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    OmegaConf.resolve(config)
    try:
        run_ppo(config)
    except KeyboardInterrupt:
        print("\ninterrupted: workers and Ray stopped", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as e:
        if os.environ.get("VERL_FULL_ERROR") == "1":
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {type(e).__name__}: {message}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
