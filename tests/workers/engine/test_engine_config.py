"""`FSDPEngine(config)` with one config object (verl/workers/engine/engine_config.py): AReaL's TrainEngineConfig
shape, verl's sections, as a dict, DictConfig or dataclass, positionally or as `config=`, reach the built engine
(its optimizer's lr, betas, clip, master dtype, gradient checkpointing, `.device`); today's keyword forms are
unchanged; a config the engine cannot read is refused naming the bad key."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from verl.workers.engine import FinetuneSpec, FSDPEngine
from verl.workers.engine.engine_config import engine_sections

pytestmark = pytest.mark.usefixtures("own_process_group")  # tests/conftest.py

AREAL = {"experiment_name": "e", "trial_name": "t", "gradient_checkpointing": True, "dtype": "bf16",
         "optimizer": {"type": "adam", "lr": 3e-3, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.0,
                       "gradient_clipping": 0.5, "warmup_steps_proportion": 0.0, "lr_scheduler_type": "constant"},
         "fsdp": {"offload_params": False}}  # fmt: skip
SECTIONS = (
    {"enable_gradient_checkpointing": True},
    {"param_offload": False, "model_dtype": "bf16"},
    {"lr": 3e-3, "betas": [0.8, 0.95], "weight_decay": 0.0, "clip_grad": 0.5, "lr_warmup_steps_ratio": 0.0,
     "lr_scheduler_type": "constant"},
    {},
)  # fmt: skip


@dataclasses.dataclass
class Optimizer:
    lr: float = 3e-3
    beta1: float = 0.8
    beta2: float = 0.95
    weight_decay: float = 0.0
    gradient_clipping: float = 0.5
    warmup_steps_proportion: float = 0.0
    lr_scheduler_type: str = "constant"
    type: str = "adam"


@dataclasses.dataclass
class TrainEngineConfig:
    path: str = ""
    gradient_checkpointing: bool = True
    dtype: str = "bf16"
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    attn_impl: str | None = None  # None: unset


def test_one_areal_config_positionally_reaches_the_built_engine(tiny_model_dir):
    """The issue's case: `FSDPEngine(cfg)` used to read cfg as the model section and train at lr 1e-6."""
    engine = FSDPEngine({**AREAL, "path": tiny_model_dir})
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=2))
    group = engine.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(3e-3) and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.0
    assert engine.optimizer_config.clip_grad == 0.5
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert engine.module.is_activation_checkpointing
    assert engine.device == torch.device("cpu") == next(engine.module.parameters()).device


def test_every_form_of_one_config_gives_the_same_sections(tiny_model_dir):
    expected = ({**SECTIONS[0], "path": tiny_model_dir}, *SECTIONS[1:])
    verl_shape = {"model": expected[0], "fsdp_config": expected[1], "optim": expected[2]}
    forms = [{**AREAL, "path": tiny_model_dir}, OmegaConf.create({**AREAL, "path": tiny_model_dir}), verl_shape,
             {"model": expected[0], "actor": {"optim": expected[2], "fsdp_config": expected[1], "ppo_epochs": 2}}]  # fmt: skip
    for form in forms:
        engine = FSDPEngine(config=form)
        got = tuple(OmegaConf.to_container(s) for s in (engine.model_config, engine.engine_config,
                                                        engine.optimizer_config, engine.checkpoint_config))  # fmt: skip
        assert got == expected, form
    dataclass_sections = engine_sections(TrainEngineConfig(path=tiny_model_dir))
    assert dataclass_sections == ({**expected[0]}, {"model_dtype": "bf16"}, expected[2], {})
    assert FSDPEngine(TrainEngineConfig(path="m")).optimizer_config.lr == 3e-3
    assert FSDPEngine({**AREAL, "use_lora": False, "lora_rank": 8}).model_config.lora_rank == 0


def test_todays_keyword_and_section_forms_are_unchanged():
    engine = FSDPEngine(model_config={"path": "m", "lora_rank": 4}, optimizer_config={"lr": 2.0}, device="cpu")
    assert engine.model_config == {"path": "m", "lora_rank": 4} and engine.optimizer_config == {"lr": 2.0}
    engine = FSDPEngine({"path": "m", "use_remove_padding": True}, {"fsdp_size": -1}, {"lr": 2.0})
    assert engine.model_config.use_remove_padding and engine.engine_config.fsdp_size == -1
    assert FSDPEngine({"path": "m"}).model_config == {"path": "m"}  # a model section alone is still one
    assert FSDPEngine().device == torch.device("cpu")


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"path": "m", "mb_spec": {"n_mbs": 2}}, ValueError, r"unknown keys/sections \['mb_spec'\]; allowed sections"),
        ({"optimizer": {"lr": 1.0, "momentum": 0.9}}, ValueError, r"optimizer has unknown keys \['momentum'\]"),
        ({"optimizer": {"type": "sgd"}}, ValueError, "optimizer.type='sgd'; allowed: adam"),
        ({"optim": {"lr": 1.0}, "optimizer": {"lr": 1.0}}, ValueError, "both optim .* and optimizer"),
        ({"path": "a", "model": {"path": "b"}}, ValueError, "sets model.path twice"),
        ({"optim": {}, "actor": {"optim": {}}}, ValueError, "both optim and actor.optim"),
        ({"fsdp": {"cpu_offload": True}}, ValueError, r"fsdp has unknown keys \['cpu_offload'\]"),
        ({"optimizer": "adam"}, TypeError, "config optimizer must be a DictConfig, dataclass or mapping, got str"),
    ],
)
def test_a_config_the_engine_cannot_read_is_refused_naming_the_key(config, error, match):
    with pytest.raises(error, match=match):
        FSDPEngine(config=config)


def test_config_and_sections_together_are_refused():
    with pytest.raises(TypeError, match="config=... alone, or its sections"):
        FSDPEngine({"path": "m"}, config={"path": "m"})
    with pytest.raises(TypeError, match="engine config must be a DictConfig, dataclass or mapping, got str"):
        FSDPEngine(config="m")
