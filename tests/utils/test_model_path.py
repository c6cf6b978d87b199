"""Model locations as verl scripts write them (a folder, or a hub id resolved from the local Hugging Face cache,
offline), `model.override_config` applied to the HF config a model is built from, and `model.external_lib`
imported by name."""

import shutil
import sys

import pytest
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from verl.utils.import_utils import import_external_libs
from verl.utils.model_path import override_model_config, resolve_model_path, resolve_model_paths


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_model_dir):
    """A Hugging Face hub cache holding the tiny model as hub id `acme/tiny-qwen2` (the layout the hub client writes)."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny-qwen2"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / "0123abc"


def test_a_cached_hub_id_resolves_to_its_snapshot_folder_and_loads(hf_cache, tiny_model_dir):
    folder = resolve_model_path("acme/tiny-qwen2", "actor_rollout_ref.model.path")
    assert folder == str(hf_cache)
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen2"
    assert resolve_model_path(tiny_model_dir, "actor_rollout_ref.model.path") == tiny_model_dir  # a folder stays


def test_resolve_model_paths_rewrites_the_used_keys_and_derived_ones_follow(hf_cache):
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": "acme/tiny-qwen2", "tokenizer_path": None}},
            "critic": {"model": {"path": "${actor_rollout_ref.model.path}"}},
            "reward": {"reward_model": {"model_path": "not/cached"}},
        }
    )
    resolve_model_paths(config, ["actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path"])
    assert config.actor_rollout_ref.model.path == str(hf_cache) and config.critic.model.path == str(hf_cache)
    assert config.actor_rollout_ref.model.tokenizer_path is None
    with pytest.raises(FileNotFoundError, match=r"reward.reward_model.model_path='not/cached' is neither a local "
                                                r"folder nor a model in the local Hugging Face cache"):  # fmt: skip
        resolve_model_paths(config, ["reward.reward_model.model_path"])


def test_a_missing_folder_or_uncached_id_is_an_error_naming_the_key(hf_cache, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"critic.model.path='Qwen/Qwen2.5-7B-Instruct' is neither .*nothing is "
                                                r"downloaded here"):  # fmt: skip
        resolve_model_path("Qwen/Qwen2.5-7B-Instruct", "critic.model.path")
    with pytest.raises(FileNotFoundError, match="actor_rollout_ref.model.path='/no/such/model': no such folder"):
        resolve_model_path("/no/such/model", "actor_rollout_ref.model.path")


def test_override_config_changes_the_model_that_is_built(tiny_model_dir):
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    assert hf_config.num_hidden_layers > 1
    override = OmegaConf.create({"num_hidden_layers": 1, "attention_dropout": 0.25, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})  # fmt: skip
    override_model_config(hf_config, override, "critic.model.override_config")
    model = AutoModelForCausalLM.from_config(hf_config)
    assert len(model.model.layers) == 1 and model.config.attention_dropout == 0.25
    assert hf_config.rope_parameters["factor"] == 2.0  # a plain dict field is replaced
    nested = AutoConfig.from_pretrained(tiny_model_dir)
    override_model_config(nested, {"model_config": {"num_hidden_layers": 1}})  # verl's Megatron-style layout
    assert nested.num_hidden_layers == 1
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.override_config=\[1\] must be a mapping"):
        override_model_config(nested, [1], "actor_rollout_ref.model.override_config")


def test_external_lib_is_imported_and_a_failure_names_key_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_arch.py").write_text("REGISTERED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_external_libs("my_arch", "actor_rollout_ref.model.external_lib")
    assert sys.modules["my_arch"].REGISTERED
    import_external_libs(None, "critic.model.external_lib")  # verl's default: nothing
    with pytest.raises(ImportError, match=r"critic.model.external_lib='no_such_arch': the module cannot be imported "
                                          r"\(ModuleNotFoundError"):  # fmt: skip
        import_external_libs(["my_arch", "no_such_arch"], "critic.model.external_lib")
