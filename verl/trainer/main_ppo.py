"""Entry point: `python -m verl.trainer.main_ppo key=value ...` (Hydra, config ppo_trainer.yaml).

Builds the tokenizer, datasets, reward managers, role -> worker mapping and resource pools, starts
(or joins, with RAY_ADDRESS) Ray, and runs `RayPPOTrainer.fit`. Configuration mistakes end with one
line on stderr naming the bad value and a non-zero exit code; Ctrl-C stops the workers and Ray.

Layer 8.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from verl.trainer.config import prepare_config, resolve_cpu_dtypes

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError, OmegaConfBaseException)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={name!r}; allowed: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():  # verl's default on a machine without a GPU
        print("notice: trainer.device=cuda but no CUDA GPU is visible: the run uses the CPU", file=sys.stderr)
        return "cpu"
    return name


MAKE_DATA_HINT = (
    "make RLLA parquet with `python dataset/rlla_4k_raw/rlla.py --local_dir DIR` (or `--synthetic N`) and GSM8K "
    "with `python examples/data_preprocess/gsm8k.py --local_dir DIR`"
)


def _as_list(files) -> list[str]:
    if files is None:
        return []
    return [files] if isinstance(files, str) else list(files)


def _check_paths(config: DictConfig) -> None:
    for key in ("train_files", "val_files"):
        if config.data.get("domains"):  # files come per domain (checked there); data.<key> is verl's default
            continue
        for f in _as_list(config.data.get(key)):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"data.{key}: no such file {f!r}; {MAKE_DATA_HINT}")
    from verl.trainer.ppo.utils import need_critic, need_reward_model
    from verl.utils.import_utils import import_external_libs
    from verl.utils.model_path import resolve_model_paths

    keys = ["actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "data.tokenizer"]
    if need_critic(config):
        keys += ["critic.model.path", "critic.model.tokenizer_path"]
    if need_reward_model(config):
        keys.append("reward.reward_model.model_path")
    resolve_model_paths(config, keys)  # hub ids -> cached folders, before Ray: every worker gets a folder
    import_external_libs(config.actor_rollout_ref.model.external_lib, "actor_rollout_ref.model.external_lib")
    if need_critic(config):
        import_external_libs(config.critic.model.external_lib, "critic.model.external_lib")
    model_path = config.actor_rollout_ref.model.path
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path!r} is not a directory (an HF model folder is needed; "
            f"nothing is downloaded)"
        )
    _check_model_is_causal_lm(model_path)
    _check_rollout_name(config)
    _check_rollout_workflow(config.actor_rollout_ref.rollout.get("workflow"))
    _check_custom_reward(config)
    _check_resume_path(config.trainer)


def _check_reward_columns(config: DictConfig, datasets: list) -> None:
    """What the reward managers read, checked on every row before Ray starts: a `reward_model` dict with a
    'ground_truth', and (without a custom reward function) a data source that has a built-in scorer."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import need_reward_model
    from verl.utils.reward_score import KNOWN_DATA_SOURCES, has_default_scorer

    custom = get_custom_reward_fn(config) is not None
    if need_reward_model(config) and not custom:  # the reward model's score is the reward: no rule scorer runs
        return
    key = config.data.reward_fn_key
    for dataset in (d for d in datasets if d is not None):
        for (path, row_number, _), row in zip(dataset.origins, dataset.rows):
            where = f"parquet file {path!r} row {row_number}"
            truth = row.get("reward_model")
            if not isinstance(truth, dict) or "ground_truth" not in truth:
                raise ValueError(
                    f"{where}: reward_model={truth!r:.120} must be a dict with a 'ground_truth' (the reward "
                    "managers pass it to the reward function)"
                )
            if not custom and not has_default_scorer(row.get(key)):
                raise ValueError(
                    f"{where}: {key}={row.get(key)!r} has no built-in reward function; known: "
                    f"{list(KNOWN_DATA_SOURCES)} (or a name starting with 'rlla'), or set custom_reward_function.path"
                )


def _check_resume_path(trainer: DictConfig) -> None:
    """resume_mode=resume_path needs a complete checkpoint folder (checked again by the trainer on load)."""
    from verl.trainer.ppo import checkpoint as ckpt

    path = trainer.get("resume_from_path")
    if trainer.get("resume_mode") == "resume_path" and (not path or not ckpt.is_complete(str(path))):
        raise FileNotFoundError(
            f"trainer.resume_from_path={path!r} holds no complete checkpoint (a global_step_N folder with a "
            f"{ckpt.COMPLETE_MARKER} file); use trainer.resume_mode=auto or disable"
        )


def _check_domains(config: DictConfig):
    """`parse_domains` (None without data.domains) plus the reward worker settings of the types in use."""
    from verl.trainer.ppo.domains import parse_domains
    from verl.workers.reward_workers import check_reward_config

    parsed = parse_domains(config)
    if parsed is not None:
        check_reward_config(config, [spec.reward_type for spec in parsed[0]])
    return parsed


def _check_model_is_causal_lm(model_path: str) -> None:
    """The model folder must hold an HF config of a causal LM (checked before Ray and the workers start)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path!r} has no config.json (an HF model folder is needed)"
        )
    hf_config = AutoConfig.from_pretrained(model_path)
    model_type = hf_config.model_type
    architectures = list(getattr(hf_config, "architectures", None) or [])
    # an architecture list naming no LM head (e.g. BertModel) is an encoder checkpoint, even if the type has one
    headless = architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING or headless:  # external_lib may register more
        raise ValueError(
            f"actor_rollout_ref.model.path={model_path!r} is a {model_type!r} model, not a causal LM "
            f"(AutoModelForCausalLM supports e.g. qwen2, llama, gpt2)"
        )


def _check_rollout_name(config: DictConfig) -> None:
    """Check the rollout engine's config before any worker starts (a registered name, one engine per rank) and
    write the adjusted keys back. Whether the engine can run (installed, built for the worker's device) is decided
    by the rollout workers themselves, where it runs (`resolve_rollout_engine`): the driver may sit on a machine
    without a GPU or without the engine."""
    from verl.workers.rollout import check_rollout_engine

    rollout = config.actor_rollout_ref.rollout
    updates, notices = check_rollout_engine(rollout)
    for line in notices:
        print(line, file=sys.stderr)
    with open_dict(rollout):
        for key, value in updates.items():
            rollout[key] = value
    if rollout.get("workflow") == "multi_turn_tool":  # its tool-call parser; unknown -> one line listing the known
        from verl.envs.tools import get_tool_call_format

        get_tool_call_format((rollout.get("multi_turn") or {}).get("format", "hermes"))


def _pick_agent_loop_workflow(config: DictConfig) -> None:
    """verl's agent loops run as the `agent_loop` rollout workflow, chosen here (before the datasets and workers
    are built) when `rollout.multi_turn.enable` is true, `rollout.agent` names another default loop or a loop config
    file, or the data files have an `agent_name` column (verl 0.9.1 runs every rollout through its agent loops;
    without any of these the default `rlvr` gives the single-turn loop's rows). As in verl 0.9.1 the rows then
    carry the chat (`data.return_raw_chat` becomes true), and the workflow gets the `data` section (chat-template
    arguments) as `workflow_kwargs.data_config`."""
    rollout = config.actor_rollout_ref.rollout
    agent = rollout.get("agent") or {}
    reasons = []
    if (rollout.get("multi_turn") or {}).get("enable", False):
        reasons.append("actor_rollout_ref.rollout.multi_turn.enable=true")
    if agent.get("default_agent_loop", "single_turn_agent") != "single_turn_agent":
        reasons.append(f"actor_rollout_ref.rollout.agent.default_agent_loop={agent.default_agent_loop}")
    if agent.get("agent_loop_config_path"):
        reasons.append("actor_rollout_ref.rollout.agent.agent_loop_config_path")
    files = _as_list(config.data.get("train_files")) + _as_list(config.data.get("val_files"))
    if any("agent_name" in _parquet_columns(f) for f in files):
        reasons.append("the data's agent_name column")
    workflow = rollout.get("workflow")
    if not reasons and workflow != "agent_loop":
        return
    if workflow not in ("rlvr", "agent_loop"):
        raise ValueError(
            f"{reasons[0]} runs verl's agent loops (actor_rollout_ref.rollout.workflow=agent_loop), but "
            f"actor_rollout_ref.rollout.workflow={workflow!r}; leave the workflow at its default rlvr"
        )
    with open_dict(config):
        config.data.return_raw_chat = True  # verl 0.9.1's dataset always gives agent loops the chat
        kwargs = rollout.get("workflow_kwargs") or {}
        kwargs = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)
        rollout.workflow = "agent_loop"
        rollout.workflow_kwargs = {**kwargs, "data_config": OmegaConf.to_container(config.data, resolve=True)}
    if workflow != "agent_loop":
        print(f"notice: actor_rollout_ref.rollout.workflow=agent_loop (verl's agent loops) for {', '.join(reasons)}",
              file=sys.stderr)  # fmt: skip


def _parquet_columns(path: str) -> list[str]:
    """The column names of a parquet file; none for a path that is not a readable parquet file (the dataset
    loader reports that one, naming the file)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path).names if os.path.isfile(path) else []
    except Exception:  # corrupt or not parquet: RLHFDataset's own error names the file
        return []


def _check_rollout_workflow(name: str | None) -> None:
    from verl.workers.rollout.workflows import get_workflow_class

    if name:
        get_workflow_class(str(name))  # unknown name or bad dotted path -> ValueError naming the allowed ones


def _check_custom_reward(config: DictConfig) -> None:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    try:
        get_custom_reward_fn(config)
    except (AttributeError, TypeError) as err:  # a missing or non-callable function name
        raise ValueError(str(err)) from err


def _check_single_process(config: DictConfig, domain_setup, rollout_pool: dict) -> None:
    """trainer.single_process=true runs one worker inside this process: refuse what needs more."""
    if not config.trainer.single_process:
        return
    n_proc = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if n_proc != 1:
        raise ValueError(
            f"trainer.single_process=true runs one worker in this process, but trainer.nnodes * "
            f"trainer.n_gpus_per_node = {n_proc}; set both to 1 or trainer.single_process=false (Ray)"
        )
    if rollout_pool:
        raise ValueError(
            "trainer.single_process=true cannot run trainer.rollout_mode=async (the rollout group is a process "
            "of its own); use trainer.rollout_mode=sync or trainer.single_process=false"
        )
    from verl.trainer.ppo.utils import reward_model_pool_spec

    if reward_model_pool_spec(config):
        raise ValueError(
            "trainer.single_process=true cannot give the reward model processes of its own; use reward.reward_model."
            "enable_resource_pool=false (it then shares the one process) or trainer.single_process=false"
        )
    if domain_setup is not None:
        raise ValueError(
            "trainer.single_process=true cannot run data.domains (its reward workers are Ray actors); "
            "use trainer.single_process=false"
        )
    if os.environ.get("RAY_ADDRESS"):
        print("warning: trainer.single_process=true ignores RAY_ADDRESS: the run does not use Ray", file=sys.stderr)


def init_ray(config: DictConfig) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local Ray session with what a training run needs: no dashboard,
    autoscaler monitor or log monitor once started (`_stop_unused_ray_daemons`; with `VERL_LEAN_RAY_HEAD=1` they are
    not even started, `_lean_head_node`), no pre-started idle worker. The object store keeps Ray's size: it is
    reserved, not resident (only the pages of objects alive count), and async rollout puts whole state dicts in
    it."""
    import ray

    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env_vars})
        return
    num_cpus = config.ray_kwargs.ray_init.num_cpus
    with _lean_head_node() if _lean_head_wanted() else contextlib.nullcontext():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env={"env_vars": env_vars},
            log_to_driver=True,
            configure_logging=True,
            logging_level="WARNING",
            # no idle worker pre-started for the driver: every worker of a run is an actor with its
            # own runtime_env, which Ray starts in a process of its own anyway
            _system_config={"prestart_worker_first_driver": False},
        )
    _stop_unused_ray_daemons()


_LOG_TAIL = None  # the WorkerLogTail that prints the workers' output in place of Ray's log monitor


LEAN_RAY_HEAD_ENV = "VERL_LEAN_RAY_HEAD"  # 1: a local head node never starts the daemons a run does not need


def _lean_head_wanted() -> bool:
    """`VERL_LEAN_RAY_HEAD` (default 0) is 1; another value is refused."""
    raw = os.environ.get(LEAN_RAY_HEAD_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{LEAN_RAY_HEAD_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


@contextlib.contextmanager
def _lean_head_node() -> Iterator[None]:
    """Opt-in (`VERL_LEAN_RAY_HEAD=1`), since it patches Ray's private `Node` class for the length of `ray.init`:
    while `ray.init` starts a local head node, keep it from starting the three daemons a training run does not need
    (`_stop_unused_ray_daemons` names them): each is a Python process that imports much of Ray, and `ray.init` waits
    for the dashboard head to come up, so a run starts sooner on a small CPU. Ray's node parameters switch off two of
    them (`no_monitor`, `include_log_monitor`); the dashboard head is left out the way Ray goes on when it fails to
    start one (no process, no URL). Where Ray lacks these names (another version), nothing is changed and
    `_stop_unused_ray_daemons` stops the daemons once they run."""
    try:
        from ray._private.node import Node

        original_init, original_api_server = Node.__init__, Node.start_api_server
    except (ImportError, AttributeError):
        yield
        return

    def init(self, ray_params, *args, **kwargs):
        ray_params.no_monitor = True
        ray_params.include_log_monitor = False
        original_init(self, ray_params, *args, **kwargs)

    def start_api_server(self, **kwargs):
        self._webui_url = None

    Node.__init__, Node.start_api_server = init, start_api_server
    try:
        yield
    finally:
        Node.__init__, Node.start_api_server = original_init, original_api_server


def _stop_unused_ray_daemons() -> None:
    """Stop three daemons a local session starts that a training run does not need (their memory goes back),
    where `_lean_head_node` could not keep them from starting (Ray's kill is a no-op for a daemon never started):
    the dashboard head (started even with include_dashboard=False, to serve usage statistics), the autoscaler
    monitor (nothing to scale on one machine) and the log monitor, whose work (the workers' output in this
    console) a thread of this process does instead, reading the same local files (`WorkerLogTail`). Ray has no
    switch for any of them in `ray.init`; this uses its node object, and leaves a daemon running if that is not
    there (another Ray version)."""
    global _LOG_TAIL
    import ray

    from verl.single_controller.ray.log_tail import WorkerLogTail

    node = getattr(ray._private.worker, "_global_node", None)
    for kill in ("kill_dashboard", "kill_monitor"):
        try:
            getattr(node, kill)(check_alive=False)
        except Exception:  # another Ray version: the daemon keeps running, only its memory is lost
            pass
    try:
        logs_dir = node.get_logs_dir_path()
        node.kill_log_monitor(check_alive=False)
    except Exception:  # another Ray version: its log monitor keeps printing the workers' output
        return
    if _LOG_TAIL is not None:  # a session before this one ended without shutdown_ray
        _LOG_TAIL.stop()
    _LOG_TAIL = WorkerLogTail(logs_dir).start()


def shutdown_ray() -> None:
    """`ray.shutdown()`, after the last of the workers' output is printed (the log tail's final read)."""
    global _LOG_TAIL
    import ray

    if _LOG_TAIL is not None:
        _LOG_TAIL.stop()
        _LOG_TAIL = None
    ray.shutdown()


def build_trainer(config: DictConfig):
    """Everything `run_ppo` does before `fit()`: returns the trainer with its workers started."""
    import torch

    from verl.single_controller import LocalWorkerGroup, RayWorkerGroup
    from verl.trainer.ppo import async_rollout
    from verl.trainer.ppo.domains import build_domain_datasets
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager, Role
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.trainer.ppo.utils import need_reward_model, reward_model_pool_spec
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
    from verl.workers.reward_workers import RewardWorkerPool

    _check_paths(config)
    domain_setup = _check_domains(config)  # data.domains: every domain's files, reward type and probability
    device = resolve_device(config.trainer.device)
    resolve_cpu_dtypes(config, device)
    with open_dict(config):
        config.actor_rollout_ref.device = device
        config.critic.device = device
    torch.manual_seed(config.trainer.seed)
    tokenizer = hf_tokenizer(
        config.data.tokenizer
        or config.actor_rollout_ref.model.get("tokenizer_path")
        or config.actor_rollout_ref.model.path,
        trust_remote_code=bool(
            config.actor_rollout_ref.model.trust_remote_code or config.data.get("trust_remote_code")
        ),
    )
    num_examine = config.reward.num_examine
    _pick_agent_loop_workflow(config)
    if domain_setup is None:
        max_train = int(config.data.train_max_samples or -1)
        train_dataset = RLHFDataset(config.data.train_files, tokenizer, config.data, max_samples=max_train)
        val_dataset = RLHFDataset(config.data.val_files, tokenizer, config.data) if config.data.val_files else None
        reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
        val_reward_fn = load_reward_manager(config, tokenizer, num_examine=num_examine)
        _check_reward_columns(config, [train_dataset, val_dataset])
    else:  # scored by the reward workers, set below once Ray runs
        train_dataset, val_dataset = build_domain_datasets(domain_setup[0], tokenizer, config.data)
        reward_fn = val_reward_fn = None

    n_proc = int(config.trainer.n_gpus_per_node)
    nnodes = int(config.trainer.nnodes)
    mapping = {Role.ActorRollout: "global_pool", Role.Critic: "global_pool"}
    rollout_pool = async_rollout.rollout_pool_spec(config)  # trainer.rollout_mode=async: the rollout's own processes
    if rollout_pool:
        mapping[Role.Rollout] = "rollout_pool"
    rm_pool = reward_model_pool_spec(config)  # reward.reward_model.enable_resource_pool: the RM's own processes
    if need_reward_model(config):
        mapping[Role.RewardModel] = "reward_pool" if rm_pool else "global_pool"
    single_process = bool(config.trainer.single_process)
    _check_single_process(config, domain_setup, rollout_pool)
    pool_manager = ResourcePoolManager(
        resource_pool_spec={"global_pool": [n_proc] * nnodes, **rollout_pool, **rm_pool},
        mapping=mapping,
        use_gpu=device == "cuda",
    )
    # the trainer checks the whole config before Ray starts, so mistakes fail in seconds
    trainer = RayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping={
            Role.ActorRollout: ActorRolloutRefWorker,
            Role.Critic: CriticWorker,
            Role.RewardModel: RewardModelWorker,
        },
        resource_pool_manager=pool_manager,
        reward_fn=reward_fn,
        val_reward_fn=val_reward_fn,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        collate_fn=collate_fn,
        ray_worker_group_cls=LocalWorkerGroup if single_process else RayWorkerGroup,
    )
    cpus_per_worker = config.trainer.get("cpus_per_worker")
    if single_process:  # the worker runs here: all the CPUs this process may use (or ray_init.num_cpus)
        num_cpus = config.ray_kwargs.ray_init.num_cpus
        cpus_per_worker = cpus_per_worker or num_cpus or len(os.sched_getaffinity(0))
    else:
        init_ray(config)
    if cpus_per_worker is None:
        cpus_per_worker = pool_manager.default_cpus_per_process()
    pool_manager.cpus_per_process = int(cpus_per_worker)
    if domain_setup is not None:  # one group of reward actors per reward type; they start while the models load
        tokenizer_path = config.data.tokenizer or config.actor_rollout_ref.model.path
        trainer.reward_pool = RewardWorkerPool(config, domain_setup[0], tokenizer_path)
        trainer.reward_fn = trainer.reward_pool.reward_fn(num_examine=0)
        trainer.val_reward_fn = trainer.reward_pool.reward_fn(num_examine=num_examine)
    trainer.init_workers()
    _print_placement(trainer)
    if trainer.reward_pool is not None:
        trainer.reward_pool.wait_ready()
    return trainer


def _print_placement(trainer) -> None:
    """One line per worker group whose ranks span several nodes: which node holds which ranks (from Ray's
    placement groups)."""
    from verl.single_controller.ray.nodes import describe_placement

    groups = {
        id(wg): wg for wg in (trainer.actor_rollout_wg, trainer.critic_wg, trainer.rm_wg, trainer.rollout_wg) if wg
    }
    for wg in groups.values():
        line = describe_placement(wg.rank_nodes, wg.label) if hasattr(wg, "rank_nodes") else None
        if line:
            print(f"placement: {line}", file=sys.stderr, flush=True)


def run_ppo(config: DictConfig) -> dict:
    """Run one training job in this process (starts Ray if needed, shuts it down at the end; with
    trainer.single_process=true the worker runs in this process and Ray is not used)."""
    import ray

    from verl.single_controller.local import close_local_worker_groups
    from verl.trainer.ppo.ray_trainer import finish_run

    started_here = not ray.is_initialized()
    try:
        prepare_config(config)  # legacy keys converted as verl does; types and refused features checked
        trainer = build_trainer(config)
        trainer.finish_after_workers_stop = True
        summary = trainer.fit()
    finally:
        close_local_worker_groups()  # trainer.single_process: the in-process worker's process group
        if started_here and ray.is_initialized():
            shutdown_ray()
    return finish_run(summary)  # plot and summary once the workers (and their memory) are gone


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    try:
        prepare_config(config)  # before resolving: derived keys still show as interpolations
        OmegaConf.resolve(config)
        run_ppo(config)
    except KeyboardInterrupt:
        print("\ninterrupted: workers and Ray stopped", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a config mistake, or a started run failing (reward, worker, NaN): one line
        from verl.trainer.ppo.failures import RUN_FAILURES, one_line

        if os.environ.get("VERL_FULL_ERROR") == "1" or not isinstance(e, USER_ERRORS + RUN_FAILURES):
            raise
        hint = "" if isinstance(e, USER_ERRORS) else " (VERL_FULL_ERROR=1 shows the traceback)"
        print(f"error: {one_line(e)}{hint}", file=sys.stderr)
        sys.exit(1)
    finally:
        # the run is over (Ray stopped, logs closed): the interpreter's last garbage collections would walk every
        # object the imports made (torch, transformers: ~1 s); frozen objects are skipped. atexit still runs.
        gc.freeze()


if __name__ == "__main__":
    main()
