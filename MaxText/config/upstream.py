"""Upstream MaxText's keys that configs/base.yml does not have, and what this trainer does with each.

Every key of upstream's base.yml (release UPSTREAM_VERSION; its defaults, as data, in
maxtext_<version>_defaults.json) has one of four behaviours:

  implemented  in configs/base.yml under the same name, with upstream's meaning (not listed here)
  mapped       this trainer has the same thing under another key: the value is carried over, with a log line
  no-op        cannot change a result here (a Google Cloud service, a TPU kernel or runtime knob, inference,
               a diagnostic aid): accepted whatever its value, and listed in one log line
  refused      a feature this trainer does not have: accepted at the value that means "off" (upstream's
               default unless the group says otherwise), and any other value is a one-line error with the
               reason

load.load_config hands this module the upstream keys a config sets (parse_value, then apply). `python -m
MaxText.upstream` prints the table as the README shows it (tests keep the two identical).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
from typing import Any, NamedTuple

import yaml

from MaxText.config import parse
from MaxText.config.checks import DECODER_BLOCKS
from MaxText.config.errors import ConfigError, clip, shown
from MaxText.config.parse import coerce, read_yaml
from MaxText.config.schema import REMAT_TENSOR_NAMES, SCHEMA

UPSTREAM_VERSION = "0.2.5"
DEFAULTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"maxtext_{UPSTREAM_VERSION}_defaults.json")

NOOP, REFUSED = "no-op", "refused"


class Group(NamedTuple):
    kind: str
    reason: str
    keys: tuple[str, ...]         # names, or fnmatch patterns (a '*'); each upstream key matches one group
    accepts: Any = None           # refused: the values meaning "off" (None: upstream's default only)


def _g(kind: str, reason: str, keys: str, accepts=None) -> Group:
    return Group(kind, reason, tuple(keys.split()), accepts)


GROUPS: tuple[Group, ...] = (
    # ------------------------------------------------------------------------------------------ no-op
    _g(NOOP, "a Google Cloud or third-party service (GCS, Vertex AI, goodput, Cloud Monitoring, ML diagnostics, "
             "W&B, MLPerf logging); metrics go to metrics.jsonl and TensorBoard here",
       "gcs_metrics save_config_to_gcs enable_goodput_recording goodput_job_name monitor_goodput "
       "goodput_upload_interval_seconds enable_pathways_goodput monitor_step_time_deviation "
       "step_deviation_interval_seconds enable_gcp_goodput_metrics enable_gcp_step_deviation_metrics "
       "report_heartbeat_metric_for_gcp_monitoring heartbeat_reporting_interval_in_seconds "
       "report_performance_metric_for_gcp_monitoring use_vertex_tensorboard vertex_tensorboard_project "
       "vertex_tensorboard_region enable_checkpoint_cloud_logger managed_mldiagnostics* upload_all_profiler_results "
       "dump_hlo_gcs_dir dump_jaxpr_gcs_dir dump_hlo_upload_all enable_wandb wandb_project_name wandb_run_name "
       "enable_mllog mllog_file prometheus_port"),
    _g(NOOP, "a TPU kernel, tiling, sparse-core or TPU/Pathways runtime option; no effect on GPU or CPU",
       "sa_* eval_sa_* local_sa_* eval_local_sa_* use_splash_scheduler local_use_splash_scheduler use_tokamax_splash "
       "use_jax_splash ring_scan_unroll use_max_logit_estimate cost_estimate_flops_fwd cost_estimate_flops_bwd "
       "dq_reduction_steps experimental_sa_quant_q_fp8 experimental_sa_quant_k_fp8 wi_tile_* wo_tile_* eval_wi_tile_* "
       "eval_wo_tile_* megablox use_tokamax_gmm use_gmm_v2 use_gmm_v2_heuristic_tiling merge_gating_gmm "
       "moe_pin_sparse_core_* moe_fsdp_all_gather_sparse_core_id moe_ep_all_gather_sparse_core_id "
       "use_gather_mosaic_kernel ragged_gather_* tpu_num_* enable_tpu_profiling_options xprof_* profile_power_events "
       "optimize_mesh_for_tpu_v6e allow_split_physical_axes custom_mesh subslice_shape num_slices "
       "enable_single_controller colocated_python_checkpointing colocated_python_data_input use_ragged_attention "
       "ragged_block_size use_raiden_ffi use_mhc_pallas_kernel mhc_pallas_kernel_* use_csa_streamindex_kernel "
       "compile_topology compile_topology_num_slices internal_compile internal_compile_num_devices "
       "max_inflight_computations use_ragged_sort moe_use_direct_token_gather use_custom_sort_vjp "
       "router_topk_matmul_vjp"),
    _g(NOOP, "serving, disaggregated inference or RL rollout; MaxText.decode decodes one prompt or a batch of token "
             "rows with a KV cache, none of these",
       "load_from_prefill_dir prefill_cache_dir inference_* prefill_slice generate_slice enable_model_warmup "
       "enable_llm_inference_pool multi_sampling return_log_prob stack_prefill_result_cache prefill_cache_axis_order "
       "ar_cache_axis_order "
       "compute_axis_order reshape_q prefill_chunk_size use_chunked_prefill enable_prefix_caching prefix_caching_* "
       "enable_padding_causal_mask mla_naive_kvcache quantize_kvcache kv_quant_axis kv_quant_dtype vllm_* "
       "use_weight_converter rollout_tensor_parallelism rollout_backend kv_tp_size moe_mlp_tp_size weight_sync_debug "
       "force_q_layout default_prompt return_routed_experts model_call_mode"),
    _g(NOOP, "a debugging, logging, profiling or compile-cache aid that changes no result (xla_flags and "
             "profiler=xplane are this trainer's own)",
       "dump_hlo dump_step dump_hlo_local_dir dump_hlo_delete_local_after dump_hlo_local_module_name "
       "dump_hlo_module_name dump_hlo_xla_flags dump_jaxpr dump_jaxpr_local_dir dump_jaxpr_delete_local_after "
       "jax_debug_log_modules debug_sharding log_config max_checkify check_vma log_step_diagnostics "
       "moe_log_max_load_ratio log_required_ragged_buffer_factor write_estimator_result hide_profiler_step_metric "
       "profile_cleanly profile_periodically_period jax_cache_dir warmup_programs_in_init "
       "block_state_before_run_start warm_input_reshard_before_run_start sharding_tolerance record_internal_nn_metrics "
       "metrics_file compiled_trainstep_file enable_jax_profiler jax_profiler_port "
       "override_logical_axis_rules shardy remove_size_one_mesh_axis_from_type jax_distributed_initialization_timeout "
       "force_unroll te_ep_overflow_check_every_n_steps compile_xla_flags"),
    _g(NOOP, "computes the same thing another way, or sizes something this trainer computes as needed",
       "use_iota_embed max_position_embeddings max_segments_per_seq "
       "checkpoint_storage_use_ocdbt "
       "checkpoint_storage_use_zarr3 checkpoint_storage_target_data_file_size_bytes checkpoint_storage_concurrent_gb "
       "checkpoint_storage_device_host_concurrent_gb max_corpus_chars param_scan_axis enable_dropout"),
    _g(NOOP, "a Grain reader tuning knob: this trainer's Grain reader shuffles by index over the whole split (no "
             "shuffle buffer) and sizes its own buffers and threads",
       "grain_per_worker_buffer_size grain_per_worker_buffer_size_eval grain_num_threads grain_num_threads_eval "
       "grain_prefetch_buffer_size grain_prefetch_buffer_size_eval grain_ram_budget_mb grain_data_source_max_workers "
       "grain_index_storage_option grain_shuffle_buffer_size"),
    _g(REFUSED, "packing here always concatenates documents and splits them into rows (a document continues in "
                "the next row; nothing is dropped or padded): upstream's concat_then_split; first_fit, "
                "upstream's default, is accepted and packs the same way", "grain_packing_type",
       ("first_fit", "concat_then_split")),
    _g(REFUSED, "nothing is read from the Hugging Face hub here (local files only), so there is no token to use",
       "hf_access_token"),
    _g(NOOP, "precision: this trainer always computes attention logits and softmax, the output logits, the router "
             "and the MoE combine in float32 (what these keys ask for when true; more precise than their false)",
       "float32_logits float32_qk_product cast_logits_to_fp32 logits_dot_in_fp32 float32_weight_sum "
       "float32_gate_logits"),
    # ------------------------------------------------------------------------------------------ refused
    _g(REFUSED, "vision, audio and multimodal input; this trainer builds text decoders",
       "use_multimodal use_audio freeze_vision_encoder_params freeze_audio_encoder_params dtype_mm "
       "remat_policy_for_vit *_for_vit *_for_audio image_path video_path audio_path image_placeholder "
       "video_placeholder audio_placeholder use_audio_in_video video_max_grid_* max_num_images_per_example "
       "vision_output_length use_mrope mrope_section position_id_per_seconds train_image_column eval_image_column"),
    _g(REFUSED, "quantized training or serving (AQT, Qwix, int8, sparsity); this trainer quantizes through TE "
                "only: its dense GEMMs (quantization) and grouped GEMMs (te_gmm_quantization)",
       "constant_bound_config replicate_quant_scale quant_cfg_path quantize_mtp quantize_router_proj "
       "quantize_logits_proj logits_proj_quant_calibration_method checkpoint_is_quantized save_quantized_params_path "
       "use_qwix_quantization use_manual_quantization *_quantization_calibration_method "
       "quantization_local_shard_count unquantized_modules weight_block_size weight_sparsity_* "
       "moe_quantize_combine_bwd_method moe_quantize_token_all_gather te_comm_gemm_overlap"),
    _g(REFUSED, "an architecture feature of a model family this trainer does not build (Gemma, Llama 4, GPT-OSS, "
                "OLMo, Qwen3-Next, DeepSeek-V3.2/V4, Kimi's QK-clip, ...)",
       "attention_bias attention_sink sliding_window_size chunk_attn_window_size causal_block_size "
       "attn_logits_soft_cap final_logits_soft_cap use_post_attn_norm use_post_ffw_norm v_norm_with_scale "
       "qk_norm_with_scale hidden_size_per_layer_input vocab_size_per_layer_input num_kv_shared_layers "
       "use_double_wide_mlp moba moba_chunk_size moba_topk use_indexer indexer_* use_sliced_mla_proj "
       "use_mla_absorbed_mqa o_lora_rank o_groups compress_ratios compressed_rope_max_timescale use_qk_clip "
       "qk_clip_threshold fused_qkv fused_mlp mhc_expansion_rate sinkhorn_iterations enable_mhc_lite engram_* gdn_* "
       "use_qk_norm_in_gdn partial_rotary_factor nope_layer_interval interleave_moe_layer_step temperature_tuning "
       "share_kv_projections global_head_dim global_num_kv_heads attention_output_dim mlp_activations_limit mlp_bias "
       "first_num_hash_layers use_untrainable_positional_embedding trainable_position_size local_rope_max_timescale "
       "global_rope_max_timescale global_rope_proportion local_rope_proportion rope_linear_scaling_factor "
       "rope_use_scale rope_min_timescale rope_truncate rope_attention_scaling rope_pairwise use_m3_model "
       "normalize_embedding_logits mla_qk_head_chunk_size csa_qk_head_chunk_size moe_expert_input_dim "
       "use_lineage inhomogeneous_layer_cycle_interval "
       "global_parameter_scale dense_init_scale mtp_reuse_input_embedding mtp_eval_target_module "
       "use_random_routing"),
    _g(REFUSED, "dropout is not built here: the models this trainer trains are pre-trained without it (upstream's "
                "own MoE model files set enable_dropout: false, and its default rate is 0)", "dropout_rate"),
    _g(REFUSED, "the model's activation is SwiGLU (silu x linear) in every MLP and expert here",
       "mlp_activations"),
    _g(REFUSED, "a parallelism or sharding scheme this trainer does not have (its mesh is data x fsdp x context x "
                "expert x tensor, its rules logical_axis_rules)",
       "dcn_diloco_parallelism dcn_fsdp_transpose_parallelism dcn_sequence_parallelism "
       "dcn_context_usp_ulysses_parallelism dcn_context_autoregressive_parallelism "
       "dcn_tensor_sequence_parallelism dcn_pipeline_parallelism dcn_autoregressive_parallelism "
       "ici_diloco_parallelism ici_fsdp_transpose_parallelism ici_sequence_parallelism "
       "ici_context_usp_ulysses_parallelism ici_context_autoregressive_parallelism ici_tensor_sequence_parallelism "
       "ici_autoregressive_parallelism ici_pipeline_parallelism num_layers_per_pipeline_stage num_pipeline_repeats "
       "pipeline_parallel_layers num_pipeline_microbatches pipeline_delay_activation_forwarding "
       "pipeline_fsdp_ag_once pipeline_fsdp_ag_per_repeat scan_pipeline_iterations scan_pipeline_repeats "
       "scan_layers_per_stage set_remat_policy_on_pipeline_iterations set_remat_policy_on_layers_per_stage "
       "context_parallel_reorder_strategy shard_mode custom_mesh_and_rule custom_mesh_and_rule_for_eval mesh_axes "
       "data_sharding "
       "input_data_sharding_logical_axes context_sharding ulysses_context_sharding logical_axis_rules_for_eval "
       "shard_optimizer_over_data dense_fsdp_use_two_stage_all_gather moe_fsdp_use_two_stage_all_gather "
       "shard_exp_on_fsdp shard_embed_moe_on_fsdp use_2d_fsdp_sharding defer_small_all_reduces vocab_tiling_ag_once "
       "use_ring_of_experts moe_topk_before_ep_all_gather moe_dispatch_no_expert_sharding "
       "moe_chunk_barrier num_moe_emb_chunks use_sequential_layers"),
    _g(REFUSED, "a training method this trainer does not have (SFT, DPO, distillation, LoRA, DiLoCo, Muon, "
                "batch ramp-up, elastic training, spike skipping)",
       "use_dpo use_sft sft_train_on_completion_only distill_* training_objective block_diffusion_* enable_diloco "
       "diloco_* dcn_bandwidth_* enable_streaming_diloco num_diloco_fragments num_communication_overlapping_steps "
       "communication_overlapping_alpha skip_step_on_spikes skip_step_interval "
       "skip_step_scaling_factor trainable_parameters_mask adamw_mask adam_eps_root muon_* lora_input_adapters_path "
       "hf_lora_adapter_path enable_rampup_batch_size per_device_batch_size_start per_device_batch_size_increment "
       "global_rampup_samples elastic_* z_loss_multiplier eval_start_step "
       "target_eval_loss activations_in_float32 use_chat_template chat_template_path "
       "chat_template"),
    _g(REFUSED, "this trainer's sequence-wise balance loss is load_balance_loss_type=sequence (DeepSeek-V3's "
                "form; Megatron's is not checked to be the same)", "moe_use_megatron_seq_aux_loss"),
    _g(REFUSED, "this trainer's numerics are fixed here: gradients in weight_dtype (float32), XLA's default "
                "matmul precision, a non-finite loss always stops the run",
       "grad_dtype matmul_precision abort_on_nan_loss abort_on_inf_loss"),
    _g(REFUSED, "a data pipeline or input option this trainer does not have (its pipelines: tfds, grain over "
                "ArrayRecord, hf over local files, synthetic; one corpus per run, packed continuously)",
       "grain_train_mixture_config_path grain_use_elastic_iterator "
       "tokenize_train_data tokenize_eval_data use_truncation expansion_factor_real_data eval_per_device_batch_size "
       "packing use_stream_chunking num_epoch generate_padding_batch_train "
       "generate_padding_batch_eval eval_dataset_name mmap_* blend_cache_dir blend_index_dir reset_attention_mask "
       "eod_mask_loss packing_max_segments_per_sample olmo_* enable_data_shuffling train_shard_in_read "
       "train_interleave_cycle_length"),
    _g(REFUSED, "a checkpointing or memory-offload mode this trainer does not have (it writes Orbax checkpoints "
                "under <run>/checkpoints; remat_policy=custom offloads activations)",
       "enable_continuous_checkpointing enable_single_replica_ckpt_restoring checkpoint_todelete_subdir "
       "checkpoint_todelete_full_path standalone_checkpointer_* enable_orbax_v1 checkpoint_conversion_fn "
       "source_checkpoint_layout enable_autocheckpoint enable_multi_tier_checkpointing "
       "multi_tier_checkpointing_backup_interval_minutes multi_tier_checkpointing_backup_interval_steps "
       "mtc_data_parallelism enable_emergency_checkpoint local_checkpoint_directory local_checkpoint_period "
       "optimizer_memory_host_offload parameter_memory_host_offload"),
    _g(REFUSED, "a rematerialisation name no layer here produces (its names: remat_policy=custom's keys in "
                "configs/base.yml); recomputing it is the only choice",
       "indexer_cutoff_threshold context mlpwi moe_x_sorted moe_routing_maps kv_proj qkv_proj query_wa_proj "
       "kv_wa_proj attention_out engram", accepts=("remat",)),
    _g(REFUSED, "this trainer always keeps each layer's input on the device under remat",
       "decoder_layer_input", accepts=("device",)),
)

# Upstream keys this trainer has under another name (the value carries over as it is): upstream key -> ours.
MAPPINGS: dict[str, str] = {
    "use_qk_norm": "qk_norm",
    "learning_rate_final_fraction": "cosine_learning_rate_final_fraction",
}


# The default job's model in configs/base.yml (a 4-layer MoE a CPU trains in a minute) is not a base for model
# files: a model file that leaves one of these out gets upstream's default for it, as in MaxText (a dense
# model file stays dense, a Mixtral file keeps 32000 tokens), with a log line.
MODEL_DEFAULT_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim", "base_mlp_dim",
                      "base_num_decoder_layers", "vocab_size", "num_experts", "num_experts_per_tok",
                      "base_moe_mlp_dim")

_DEFAULT_JOB = "configs/base.yml is also the default job, a CPU-sized demo that trains in under a minute"
# Implemented keys whose default here differs from upstream's (besides MODEL_DEFAULT_KEYS), with the reason; the
# README lists them (Coming from MaxText), and a run with a model file names those it leaves at these defaults.
DEFAULT_DIFFERENCES: dict[str, str] = {
    "steps": _DEFAULT_JOB, "log_period": _DEFAULT_JOB, "per_device_batch_size": _DEFAULT_JOB,
    "max_target_length": _DEFAULT_JOB, "learning_rate": _DEFAULT_JOB, "dataset_type": _DEFAULT_JOB,
    "dataset_name": _DEFAULT_JOB, "eval_interval": _DEFAULT_JOB, "eval_steps": _DEFAULT_JOB,
    "checkpoint_period": _DEFAULT_JOB,
    "base_output_directory": "the default job writes under ./outputs; upstream's empty value (its ./maxtext_output) "
                             "is read as upstream reads it",
    "hardware": "upstream's tpu is refused here; auto uses the GPUs where JAX finds them, else the CPU",
    "decoder_block": "null checks no model family (upstream's llama2 names its dense default model)",
    "tokenizer_type": "null reads the tokenizer's kind from tokenizer_path's suffix (.model or .json)",
    "logical_axis_rules": "rules over this trainer's mesh axes (data, fsdp, expert, tensor); upstream's default "
                          "rules are replaced by these",
    "save_checkpoint_on_start": "a fresh run's step 0 is its seed, nothing to lose; saving it writes a whole "
                                "checkpoint (minutes at 671B) before the first step",
    "max_num_checkpoints_to_keep": "the newest 3 are kept rather than every checkpoint, which fills a disk on a "
                                   "long run; null keeps all",
}


@functools.cache
def upstream_defaults() -> dict[str, Any]:
    """{key: default} of upstream's base.yml (UPSTREAM_VERSION), as stored beside this module."""
    with open(DEFAULTS_FILE) as f:
        data = json.load(f)
    assert data["version"] == UPSTREAM_VERSION, (data["version"], UPSTREAM_VERSION)
    return data["defaults"]


def group_of(key: str) -> Group | None:
    """The group whose names or patterns hold `key` (names before patterns), or None."""
    for group in GROUPS:
        if key in group.keys:
            return group
    for group in GROUPS:
        if any("*" in p and fnmatch.fnmatchcase(key, p) for p in group.keys):
            return group
    return None


def accepted_values(key: str, group: Group) -> tuple:
    """The values of a refused key that mean "off"."""
    if group.accepts is not None:
        return group.accepts
    default = upstream_defaults()[key]
    return (default, None, "", "None") if default in (None, "", "None") else (default,)


# Upstream remat_policy names in this trainer's tensor names: {tensor: location}; the rest recompute.
_QKV = ("query_proj", "key_proj", "value_proj")
_MATMULS = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
REMAT_POLICIES = {
    "minimal_with_context": ("minimal", "this trainer has no 'context' tensor name: the attention context is "
                                        "recomputed"),
    "minimal_flash": ("minimal", "upstream's old name of minimal_with_context; the attention context is recomputed"),
    "save_dot_with_context_except_mlp": ({n: "device" for n in (*_QKV, "out_proj")}, "the context is recomputed"),
    "save_dot_except_mlpwi": ({n: "device" for n in (*_QKV, "out_proj", "mlpwo", "moe_mlpwo")}, ""),
    "save_dot_except_mlp": ({n: "device" for n in (*_QKV, "out_proj")}, ""),
    "save_qkv_proj": ({n: "device" for n in _QKV}, ""),
    "qkv_proj_offloaded": ({n: "offload" for n in _QKV}, ""),
    "minimal_offloaded": ({n: "offload" for n in _MATMULS}, ""),
    "save_out_proj": ({"out_proj": "device"}, ""),
}

# Values of keys both have, spelled as upstream spells them: (key, upstream value) -> (our value, note).
VALUE_SPELLINGS = {
    ("attention_type", "global"): ("mha", "upstream's name of standard (grouped-query) attention"),
    ("attention", "autoselected"): ("dot_product", "the attention that runs on every platform here (XLA "
                                                   "dot-product; attention=cudnn_flash is cuDNN's fused kernel)"),
    ("attention", "cudnn_flash_te"): ("cudnn_flash", "cuDNN's fused attention through Transformer Engine: the "
                                                     "same cuDNN fused-attention kernel, called through JAX"),
    ("attention", "cudnn_flash_jax"): ("cudnn_flash", "cuDNN's fused attention through JAX: the same kernel, "
                                                      "through JAX's cuDNN binding"),
    ("te_gmm_quantization", ""): ("none", "upstream's empty value: no quantization"),
    ("te_gmm_quantization", "te_no_quant"): ("none", "TE's grouped GEMMs without quantization"),
    ("te_gmm_quantization", "te_mxfp8"): ("mxfp8", "TE's grouped GEMMs in MXFP8"),
    ("quantization", ""): ("none", "upstream's empty value: no quantization"),
    ("quantization", "te_no_quant"): ("none", "TE's dense GEMMs without quantization"),
    ("routed_score_func", ""): ("softmax", "upstream's empty value: softmax scores"),
}

# Upstream values of keys both have that this trainer refuses: (key, value) -> reason.
REFUSED_VALUES = {
    ("attention", "flash"): "a TPU (Pallas splash) kernel; use attention=dot_product or chunked",
    ("attention", "paged"): "paged attention is for inference; use attention=dot_product or chunked",
    ("attention", "vllm_rpa"): "vLLM attention is for inference; use attention=dot_product or chunked",
    ("attention", "vllm_batched_rpa"): "vLLM attention is for inference; use attention=dot_product or chunked",
    ("attention_type", "local_sliding"): "sliding-window attention is not built here (mha or mla)",
    ("attention_type", "chunk"): "chunked local attention (Llama 4) is not built here (mha or mla)",
    ("attention_type", "full"): "this attention variant is not built here (mha or mla)",
    ("attention_type", "compressed"): "compressed attention (DeepSeek-V4) is not built here (mha or mla)",
    ("attention_type", "block_diffusion"): "block-diffusion attention is not built here (mha or mla)",
    ("hardware", "tpu"): "this trainer targets NVIDIA GPUs (and runs on CPU); use hardware=gpu, "
                         "gpu_multiprocess, cpu or auto",
    ("dataset_type", "c4_mlperf"): "the MLPerf C4 pipeline is not here (tfds, grain, hf, synthetic)",
    ("dataset_type", "olmo_grain"): "the OLMo Grain pipeline is not here (tfds, grain, hf, synthetic)",
    ("profiler", "nsys"): "NVTX ranges and cudaProfilerStart/Stop are not emitted yet; use profiler=xplane, or run "
                          "the whole job under nsys profile",
    ("opt_type", "adam_pax"): "only adamw is built here",
    ("opt_type", "sgd"): "only adamw is built here",
    ("opt_type", "muon"): "only adamw is built here",
    ("rope_type", "llama3.1"): "Llama 3.1's RoPE scaling is not built here (default or yarn)",
    **{("context_parallel_strategy", value): "only the all-gather strategy is built here (each device's queries "
                                             "against the gathered keys and values); use all_gather"
       for value in ("ring", "ulysses", "usp")},
    ("quantization", "te_fp8_delayedscaling"): "delayed scaling keeps an amax history per GEMM, which this trainer "
                                               "does not carry in its state or checkpoints; use "
                                               "te_fp8_currentscaling (the same FP8 GEMMs, each scaled by its "
                                               "own amax)",
    **{("quantization", value): "AQT / Qwix quantization (upstream's non-TE recipes) is not built here; this "
                                "trainer quantizes through TE: quantization=te_fp8_currentscaling, te_mxfp8 or te_nvfp4"
       for value in ("fp4", "int4", "int8", "intmp", "fp8_e5m2", "fp8_e4m3", "fp8", "nanoo_fp8", "fp8_nanoo",
                     "fp8_gpu", "fp8_full", "serve_fp8_weight")},
    ("remat_policy", "minimal_with_quantization"): "it names AQT's quantized tensors, which are not built here: "
                                                   "use remat_policy=minimal",
    ("remat_policy", "minimal_with_context_and_quantization"): "it names AQT's quantized tensors, which are not "
                                                               "built here: use remat_policy=minimal",
}


def show(value: Any) -> str:
    """A value as it is written on the command line: true/false, null, '' for the empty string."""
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, (list, tuple, dict)):
        return shown(value)
    return clip(str(value)) if value != "" else "''"


def parse_value(key: str, value: Any, origin: str) -> Any:
    """An upstream key's value parsed by the type of upstream's default (loosely where that is null or a map)."""
    default = upstream_defaults()[key]
    if default is None or default == "None" or isinstance(default, dict):
        if isinstance(value, str):
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
        return value
    return coerce(key, value, default, origin)


def _refuse_if_on(key: str, value: Any, origin: str) -> None:
    """A refused upstream key set to something other than "off" is a one-line error with the group's reason."""
    group = group_of(key)
    accepted = accepted_values(key, group)
    if group.kind == REFUSED and value not in accepted:
        raise ConfigError(f"{key}={show(value)} ({origin}) is a MaxText key this trainer does not support: "
                          f"{group.reason}; remove it or set {key}={show(accepted[0])}")


def check_model_file(path: str, layer: dict[str, Any]) -> None:
    """An upstream model file of a family this trainer does not build, or with a feature it refuses, stops on that
    cause in one line, before any key of its own that upstream's base.yml lacks could be called unknown."""
    block = layer.get("decoder_block")
    if block is not None and block not in DECODER_BLOCKS:
        raise ConfigError(f"model file {path} is MaxText's decoder_block={block}, a model family this trainer does "
                          f"not build (it builds {', '.join(DECODER_BLOCKS)})")
    for key, value in layer.items():
        if key in upstream_defaults() and group_of(key) is not None:
            _refuse_if_on(key, parse_value(key, value, f"in {path}"), f"in {path}")


def apply(values: dict[str, Any], defaults: dict[str, Any], foreign: dict[str, tuple[Any, str]],
          explicit: set[str]) -> None:
    """Upstream MaxText's keys and values, as the tables above give them: mapped keys carried over onto ours (an error
    when ours is also set to something else), refused keys checked to be off, no-op keys listed in one log
    line, and upstream's spellings of our keys' values translated or refused with the reason."""
    noop = []
    for key, (value, origin) in foreign.items():
        if key in MAPPINGS:
            ours = MAPPINGS[key]
            carried = coerce(ours, value, defaults[ours], origin)
            if ours in explicit and values[ours] != carried:
                raise ConfigError(f"{key}={show(value)} ({origin}) is MaxText's spelling of {ours}, but "
                                  f"{ours}={show(values[ours])} is also set; keep one")
            values[ours] = carried
            logging.warning("config: %s=%s is MaxText's spelling of %s; using %s=%s", key, show(value), ours, ours,
                            show(carried))
            continue
        if group_of(key).kind == NOOP:
            noop.append(key)
            continue
        _refuse_if_on(key, value, origin)
    if noop:
        logging.warning("config: MaxText keys with no effect here (README: Coming from MaxText): %s",
                        ", ".join(sorted(noop)))
    for key in ("attention_type", "attention", "te_gmm_quantization", "quantization", "routed_score_func", "hardware",
                "dataset_type", "profiler", "opt_type", "rope_type", "remat_policy", "context_parallel_strategy"):
        value = values[key]
        if (key, value) in REFUSED_VALUES:
            raise ConfigError(f"{key}={value} is a MaxText value this trainer does not support: "
                              f"{REFUSED_VALUES[key, value]}")
        if (key, value) in VALUE_SPELLINGS:
            values[key], note = VALUE_SPELLINGS[key, value]
            logging.warning("config: %s=%s is MaxText's value for %s; using %s=%s", key, show(value), note, key,
                            values[key])
    if values["logical_axis_rules"] == upstream_defaults()["logical_axis_rules"]:  # a copied base.yml
        values["logical_axis_rules"] = defaults["logical_axis_rules"]
        logging.warning("config: logical_axis_rules is MaxText's default (over its own mesh axes); using this "
                        "trainer's default rules")
    policy = REMAT_POLICIES.get(values["remat_policy"])
    if policy is not None:
        saved, note = policy
        name = values["remat_policy"]
        if saved == "minimal":
            values["remat_policy"] = "minimal"
        else:
            values["remat_policy"] = "custom"
            values.update({tensor: saved.get(tensor, "remat") for tensor in REMAT_TENSOR_NAMES})
        logging.warning("config: remat_policy=%s is MaxText's policy; using remat_policy=%s%s%s", name,
                        values["remat_policy"], "".join(f" {t}={loc}" for t, loc in saved.items())
                        if saved != "minimal" else "", f" ({note})" if note else "")


def same_default(key: str, ours: Any) -> bool:
    """Whether this trainer's default `ours` for upstream's `key` means what upstream's default means."""
    theirs = upstream_defaults()[key]
    unset = (None, "", "None") + ((-1, -1.0) if key in SCHEMA and SCHEMA[key].minus_one_null else ())
    if ours in unset and theirs in unset:
        return True
    spelled = VALUE_SPELLINGS.get((key, theirs)) if isinstance(theirs, str) else None
    return ours == theirs or (spelled is not None and spelled[0] == ours) or (
        key in ("sparse_matmul", "te_moe_block", "model_name") and ours is None)  # unset: moe_impl decides, no model


def model_defaults(values: dict[str, Any], given: set[str], model_path: str) -> None:
    """A model file's values: MODEL_DEFAULT_KEYS it (and the config) leaves out take upstream's defaults; the keys
    left at a default that differs from upstream's are named in one log line."""
    applied = [k for k in MODEL_DEFAULT_KEYS if k not in given]
    for key in applied:
        values[key] = upstream_defaults()[key]
    if applied:
        logging.warning("config: %s leaves %s unset; MaxText's defaults apply (not the default job's model): %s",
                        model_path, ", ".join(applied), ", ".join(f"{k}={show(values[k])}" for k in applied))
    left = [k for k in DEFAULT_DIFFERENCES
            if k not in given and k != "logical_axis_rules" and not same_default(k, values[k])]
    if left:
        logging.warning("config: left at this trainer's defaults, which differ from MaxText's (README: Coming from "
                        "MaxText): %s", ", ".join(f"{k}={show(values[k])} (MaxText: {show(upstream_defaults()[k])})"
                                                  for k in left))


def block_routing_keys(values: dict[str, Any]) -> dict[str, Any]:
    """The routing keys whose value upstream's decoder_block fixes, whatever its config says (its moe.py):
    mixtral and qwen3_moe take the softmax over the top-k router logits (softmax scores renormalised over the k
    chosen: norm_topk_prob true); deepseek renormalises sigmoid scores over the k chosen and never softmax ones."""
    block = values.get("decoder_block")
    if block in ("mixtral", "qwen3_moe"):
        return {"routed_score_func": "softmax", "norm_topk_prob": True}
    if block == "deepseek" and values.get("num_experts", 1) > 1:
        return {"norm_topk_prob": values["routed_score_func"] == "sigmoid"}
    return {}


def block_routing(values: dict[str, Any], stated: set[str]) -> None:
    """decoder_block's routing as upstream builds it (block_routing_keys). A key `stated` (by the model file, the
    command line or a config file other than a copy of upstream's base.yml) that asks otherwise is a one-line
    error rather than a model upstream would not build; an unstated one takes the block's value."""
    for key, want in block_routing_keys(values).items():
        if values[key] != want:
            if key in stated:
                raise ConfigError(f"decoder_block={values['decoder_block']} routes as {key}={show(want)} here (as "
                                  f"MaxText builds the block, whatever its config says), but {key}="
                                  f"{show(values[key])} is set; remove {key} or decoder_block")
            values[key] = want


def implemented_keys() -> list[str]:
    """Upstream's keys that configs/base.yml has (same name, upstream's meaning), in upstream's order."""

    ours = read_yaml(parse.BASE_CONFIG)
    return [k for k in upstream_defaults() if k in ours]


def _keys(names) -> str:
    return " ".join(f"`{n}`" for n in names)


def markdown() -> str:
    """The README's table of upstream keys and values."""
    lines = [f"Upstream MaxText {UPSTREAM_VERSION}'s `base.yml` has {len(upstream_defaults())} keys; each has one "
             "behaviour here (MaxText/config/upstream.py; tests/test_upstream_keys.py checks the table against the key "
             "list stored in tests/data).", "",
             "| behaviour | keys | what happens |", "|---|---|---|",
             f"| implemented | {len(implemented_keys())} keys of `configs/base.yml`: {_keys(implemented_keys())} | "
             "same name and meaning; upstream's default, except those below |"]
    for key, ours in MAPPINGS.items():
        lines.append(f"| mapped | `{key}` | carried over to `{ours}`, with a log line; both set differently: "
                     "an error |")
    for kind in (NOOP, REFUSED):
        for group in (g for g in GROUPS if g.kind == kind):
            what = ("accepted with any value, listed in one log line" if kind == NOOP else
                    "accepted " + (f"at {', '.join(f'`{v}`' for v in group.accepts)}" if group.accepts else
                                   "at upstream's default") + "; any other value is an error")
            lines.append(f"| {kind} | {_keys(group.keys)} | {group.reason}: {what} |")
    ours = read_yaml(parse.BASE_CONFIG)
    lines += ["", "Defaults that differ from upstream's (a run with a model file names those it leaves at them in one "
              "log line):", "", "| key | here | upstream | why |", "|---|---|---|---|"]
    for key in MODEL_DEFAULT_KEYS:
        lines.append(f"| `{key}` | {show(ours[key])} | {show(upstream_defaults()[key])} | the default job's model; "
                     "a model file that leaves it out gets upstream's default |")
    for key, reason in DEFAULT_DIFFERENCES.items():
        here, theirs = ("this trainer's rules" if key == "logical_axis_rules" else show(ours[key]),
                        "upstream's rules" if key == "logical_axis_rules" else show(upstream_defaults()[key]))
        lines.append(f"| `{key}` | {here} | {theirs} | {reason} |")
    lines += ["", "Upstream's values of keys both have:", "", "| value | here |", "|---|---|"]
    for (key, value), (ours, note) in VALUE_SPELLINGS.items():
        lines.append(f"| `{key}={value}` | `{key}={ours}`: {note} |")
    for name, (saved, note) in REMAT_POLICIES.items():
        target = "`remat_policy=minimal`" if saved == "minimal" else "`remat_policy=custom` " + " ".join(
            f"`{t}={loc}`" for t, loc in saved.items())
        lines.append(f"| `remat_policy={name}` | {target}" + (f" ({note})" if note else "") + " |")
    for (key, value), reason in REFUSED_VALUES.items():
        lines.append(f"| `{key}={value}` | refused: {reason} |")
    return "\n".join(lines) + "\n"
