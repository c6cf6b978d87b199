"""Which verl 0.9.1 config keys this project does not implement, and which ones it accepts without effect.

Owns two tables read by `verl.trainer.config.checks`:
- `REFUSED`: reason -> key patterns. Each key names a feature this project does not have (Megatron, Ulysses
  sequence parallelism, profilers, multi-modal data, ...) or a value of a feature it has only in part. verl's
  default value (and the values `ALSO_ALLOWED` lists for the key) is accepted; any other value stops start-up
  with one line naming the key, the value and the reason.
- `NO_EFFECT`: reason -> key patterns. Settings that cannot change anything here (an optimisation verl applies
  on GPUs whose results equal ours); a non-default value is accepted with one notice line.
Patterns are dotted config paths with `fnmatch` wildcards (`*` matches across dots). Every other key of the
config is read by the code and does what verl does. Layer 1 data: imports nothing.
"""

from __future__ import annotations

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic")
FSDP = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
MODELS = ("actor_rollout_ref.model", "critic.model")


def _each(prefixes: tuple[str, ...], *suffixes: str) -> list[str]:
    return [f"{p}.{s}" for p in prefixes for s in suffixes]


REFUSED: dict[str, list[str]] = {
    "profiling hooks (nsys, npu, torch profiler, precision debugger) are not implemented": [
        "global_profiler.*",
        *_each(ROLES, "profiler.*"),
    ],
    "Megatron/TorchTitan/VeOmni engines are not implemented; this project trains with FSDP2": [
        "actor_rollout_ref.actor.strategy",
        "critic.strategy",
        *_each(FSDP, "turbo_config.*"),
    ],
    "Ulysses sequence parallelism is not implemented (1 = off is the only value)": [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size",
        *_each(FSDP, "ulysses_sequence_parallel_size"),
    ],
    "quantisation-aware training is not implemented": [
        "actor_rollout_ref.actor.qat.*",
        *_each(FSDP, "qat.*"),
        "actor_rollout_ref.rollout.quantization",
        "actor_rollout_ref.rollout.quantization_config_file",
        "actor_rollout_ref.rollout.qat",
    ],
    "multi-token prediction (MTP) and speculative decoding are not implemented": [
        *_each(MODELS, "mtp.*"),
        "actor_rollout_ref.rollout.mtp",
    ],
    "the Megatron-style `model.lora` block is not implemented; use model.lora_rank / lora_alpha / target_modules": [
        *_each(MODELS, "lora.*"),
    ],
    "this LoRA option is not implemented (adapters start fresh on every target module)": [
        *_each(MODELS, "exclude_modules", "lora_adapter_path"),
        "critic.model.lora_rank",
        "critic.model.lora_alpha",
        "critic.model.target_modules",
    ],
    "GPU kernels (Liger, fused log-prob kernels, tiled MLP) are not implemented": [
        *_each(MODELS, "use_liger", "use_fused_kernels", "fused_kernel_options.*", "tiled_mlp.*"),
        "actor_rollout_ref.actor.use_fused_kernels",
    ],
    "this model-loading option is not implemented": [
        *_each(MODELS, "use_shm", "hf_config_path", "custom_chat_template", "enable_activation_offload"),
        "data.use_shm",
    ],
    "multi-modal (image/video/audio) data is not implemented; text prompts only": [
        "data.image_patch_size",
        "data.image_key",
        "data.video_key",
        "data.audio_key",
        "data.return_multi_modal_inputs",
        "data.mm_processor_kwargs",
        "actor_rollout_ref.actor.freeze_vision_tower",
    ],
    "this data-loading option is not implemented": [
        "data.filter_overlong_prompts_workers",
        "data.custom_cls.*",
    ],
    "this FSDP option is not implemented (FSDP2 shards every decoder layer over all ranks)": [
        *_each(FSDP, "wrap_policy.min_num_params", "fsdp_size", "use_orig_params", "seed", "full_determinism"),
        *_each(FSDP, "entropy_checkpointing", "use_no_sync_for_gradient_accumulation", "pad_to_length"),
        *_each(FSDP, "pad_to_length_bucket", "forward_only", "entropy_from_logits_with_chunking"),
        *_each(FSDP, "entropy_from_logits_chunk_size"),
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking",
        "actor_rollout_ref.actor.entropy_from_logits_chunk_size",
        "actor_rollout_ref.actor.entropy_checkpointing",
        "actor_rollout_ref.actor.pad_to_length",
        "actor_rollout_ref.ref.entropy_from_logits_with_chunking",
        "actor_rollout_ref.ref.entropy_from_logits_chunk_size",
        "actor_rollout_ref.ref.entropy_checkpointing",
        "actor_rollout_ref.ref.pad_to_length",
    ],
    "this actor option is not implemented": [
        "actor_rollout_ref.actor.use_prefix_grouper",
        "actor_rollout_ref.actor.loss_scale_factor",
        "critic.loss_scale_factor",
        "actor_rollout_ref.actor.checkpoint.async_save",
        "actor_rollout_ref.actor.checkpoint.strict",
        "critic.checkpoint.async_save",
        "actor_rollout_ref.actor.optim.optimizer",
        "actor_rollout_ref.actor.optim.optimizer_impl",
        "critic.optim.optimizer",
        "critic.optim.optimizer_impl",
    ],
    "this rollout-server option (verl's vLLM/SGLang server mode, custom async servers, routing) is not implemented": [
        "actor_rollout_ref.rollout.nnodes",
        "actor_rollout_ref.rollout.data_parallel_size",
        "actor_rollout_ref.rollout.expert_parallel_size",
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        "actor_rollout_ref.rollout.cudagraph_capture_sizes",
        "actor_rollout_ref.rollout.logprobs_mode",
        "actor_rollout_ref.rollout.scheduling_policy",
        "actor_rollout_ref.rollout.layered_summon",
        "actor_rollout_ref.rollout.over_sample_rate",
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "actor_rollout_ref.rollout.engine_kwargs.trtllm",
        "actor_rollout_ref.rollout.router_config_path",
        "actor_rollout_ref.rollout.agent.custom_async_server.*",
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module",
        "actor_rollout_ref.rollout.trace.backend",
        "actor_rollout_ref.rollout.trace.token2text",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker",
        "actor_rollout_ref.rollout.skip_tokenizer_init",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
        "actor_rollout_ref.rollout.prometheus.*",
        "actor_rollout_ref.rollout.disaggregation.*",
        "actor_rollout_ref.rollout.full_determinism",
    ],
    "verl's tool agent loop truncates a tool response on one of these sides": [
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
    ],
    "this algorithm option is not implemented": [
        "algorithm.use_pf_ppo",
        "algorithm.pf_ppo.*",
        "algorithm.filter_groups.max_inflight_gen_batches",
    ],
    "the reward loop's server options (a reward model served by vLLM/SGLang, reward-loop classes) are not "
    "implemented; the reward model runs as an FSDP worker group": [
        "reward.reward_model.rollout.*",
        "reward_model.rollout.*",
        "reward.reward_manager.source",
        "reward.reward_manager.module.*",
        "reward_model.reward_loop_source",
        "reward_model.reward_loop_module_path",
        "reward_model.reward_loop_class_name",
        "reward_model.model.external_lib",
    ],
    "verl derives this key from another one; set that one instead (e.g. rollout.n, model.use_remove_padding)": [
        "actor_rollout_ref.actor.rollout_n",
        "actor_rollout_ref.ref.rollout_n",
        "actor_rollout_ref.actor.use_remove_padding",
        "actor_rollout_ref.rollout.n_gpus_per_node",
        "actor_rollout_ref.rollout.trace.*",
        "actor_rollout_ref.actor.checkpoint.load_contents",
        "critic.checkpoint.load_contents",
        "data.tool_config_path",
        "data.function_tool_path",
    ],
    "reward-loop workers are not implemented: rewards are scored in the driver (or by data.domains reward actors)": [
        "reward.num_workers",
        "reward_model.num_workers",
    ],
    "these data options are not implemented": [
        "data.return_raw_input_ids",
        "data.validation_shuffle",
    ],
    "on-policy distillation is not implemented": ["distillation.*"],
    "the transfer queue is not implemented": ["transfer_queue.*"],
    "verl's rollout skip/dump manager is not implemented; see trainer.rollout_data_dir": ["skip.*"],
    "verl 0.9.1 removed rollout mode 'sync' (only async: requests go through rollout workflows)": [
        "actor_rollout_ref.rollout.mode",
    ],
    "this learning-rate schedule option is not implemented": [
        "actor_rollout_ref.actor.optim.num_cycles",
        "actor_rollout_ref.actor.optim.zero_indexed_step",
        "critic.optim.num_cycles",
        "critic.optim.zero_indexed_step",
    ],
    "verl's v1 trainer modes (colocate/separate async) are not implemented; see trainer.rollout_mode=async": [
        "trainer.v1.*",
    ],
    "verl 0.9.1's PPO trainer runs only the hybrid engine (it asserts hybrid_engine=true); a separate rollout "
    "group is trainer.rollout_mode=async here": ["actor_rollout_ref.hybrid_engine"],
    "verl's worker-implementation switch takes 'auto', 'enable' or 'disable'": ["trainer.use_legacy_worker_impl"],
    "this Ray option is not implemented": [
        "ray_kwargs.ray_init.runtime_env.py_executable",
        "ray_kwargs.timeline_json_file",
    ],
}

# Values accepted besides verl's default for keys in REFUSED (e.g. both FSDP spellings run FSDP2 here).
ALSO_ALLOWED: dict[str, tuple] = {
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "critic.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("left", "right"),
    "trainer.use_legacy_worker_impl": ("enable", "disable"),
}

NO_EFFECT: dict[str, list[str]] = {
    "torch.compile of the log-prob helpers is an optimisation this project does not apply; results are the same": [
        "actor_rollout_ref.actor.use_torch_compile",
        "actor_rollout_ref.ref.use_torch_compile",
        *_each(FSDP, "use_torch_compile"),
    ],
    "`fsdp` and `fsdp2` both run FSDP2 here (FSDP1 segfaults on CPU)": [
        "actor_rollout_ref.ref.strategy",
        *_each(FSDP, "strategy"),
    ],
    "verl's v1 trainer switch: this project has one trainer": ["trainer.use_v1"],
    "entropy is always computed here (the actor/entropy metric); the switch changes nothing": [
        "actor_rollout_ref.actor.calculate_entropy",
    ],
    "the HDFS copy of checkpoints is not implemented; checkpoints stay in trainer.default_local_dir": [
        "trainer.default_hdfs_dir",
    ],
    "verl 0.9.1's agent loops do not read it either (only its removed SGLang multi-turn rollout did)": [
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
    ],
    "agent loops run inside each rollout worker (all of its rows at once), not in separate agent-loop workers": [
        "actor_rollout_ref.rollout.agent.num_workers",
    ],
    "verl's choice between its legacy FSDP workers and its model-engine workers; this project has one FSDP2 "
    "worker implementation": ["trainer.use_legacy_worker_impl"],
    "verl 0.9.1 reads it nowhere either (its workers start torch.distributed with torch's default timeout)": [
        "actor_rollout_ref.nccl_timeout",
    ],
    "verl 0.9.1 removed this switch (its reward loop always runs); here the reward manager scores whole batches "
    "either way, with the same scores": ["reward_model.use_reward_loop"],
    "the reward model runs padded batches with its weights on its device; this speed/memory option of verl's "
    "legacy reward-model worker does not change scores": [
        "reward_model.model.use_remove_padding",
        "reward_model.model.fsdp_config.param_offload",
    ],
}
