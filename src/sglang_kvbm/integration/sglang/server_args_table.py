"""Every field of SGLang's ``ServerArgs``, classified by what it does to a block's identity.

Four disjoint sets; together they name every field of ``ServerArgs`` (a ``msgspec.Struct``:
``ServerArgs.__struct_fields__``) of every SGLang release in :data:`SGLANG_VERSIONS` (the union: a
field one release lacks is in :data:`ABSENT_IN` for it, and absent from its servers' identity,
never defaulted into it):

* :data:`KV_BYTES`: the value changes the bytes a page of some pool holds for the same token ids
  (full/SWA KV, Mamba/SSM state, indexer cache, a draft model's KV), or which shard of heads,
  tokens or layers a rank holds. Part of the identity.
* :data:`KV_FILES`: names a file, directory or hub id whose *content* changes those bytes. The
  identity hashes the content, never the path.
* :data:`NAMESPACE`: changes what blocks are named (block-id hash chain, ``extra_key``, published
  event hashes) or with whom they are shared, not their bytes.
* :data:`NEITHER`: everything else (ports, logging, scheduling, memory sizes, API options, and
  numerics-only kernel choices: every KV cache, SGLang's HiCache included, treats the same model's
  KV from different kernels as the same KV).

How it was built: every field was read with its help text (``sglang/srt/arg_groups/fields/*.py``)
and, where the text left it open, where SGLang uses it (``grep -rn get_<ns>().<field>``,
``configs/model_config.py``, ``mem_cache/``, ``arg_groups/*_hook.py``). Where a flag changes what a
model computes beyond kernel tolerance (other weights, quantization of weights or activations,
rope, attention masks, pool layouts), it is KV_BYTES; a grey case errs that way, since a needless
split only costs sharing while a missed one serves wrong KV.

Read values from the *resolved* record (``ServerArgs.resolve_once()``, then ``resolved_dict()``):
resolution folds deprecated and implied inputs, e.g. ``--dp-size N --enable-dp-attention``
becomes ``attn_dp_size=N, dp_size=1``, ``--enable-waterfill`` sets
``enforce_shared_experts_fusion``, ``speculative_draft_model_quantization`` defaults to
``quantization``. Inputs that only resolve into a KV_BYTES field are listed there too, so raw input
values stay on the safe side. What a pool itself reports (class, dtype, layout NHD/HND/page-major,
page bytes) is recorded from the pool by the fingerprint, whatever flag chose it.

On an SGLang upgrade: install it, run ``pytest tests/sglang/test_server_args_table.py``; it lists the
fields this table lacks and those SGLang dropped. Classify each new field here (read its help text
and its uses as above), note dropped ones in :data:`ABSENT_IN` (delete them once no supported release has them), then add the
release to :data:`SGLANG_VERSIONS`. Re-read the help text
of fields already in KV_BYTES/KV_FILES whose meaning may have moved (``git diff`` of
``arg_groups/fields/``). This module imports nothing from SGLang: it is plain data.
"""

from __future__ import annotations

SGLANG_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")  # the releases whose ServerArgs this table was checked against

# The table's fields a release's ServerArgs does not have (0.5.21: 519 fields, 0.5.22: 536, 0.5.23: 546).
ABSENT_IN: dict[str, frozenset[str]] = {
    "0.5.21": frozenset({
        "attn_dp_size", "aux_hidden_state_capture", "disaggregation_decode_allocation_policy", "dsa_triton_union",
        "enable_amd_monokernel", "enable_cp_tp_group_sharing", "enable_dsa_fused_indexer",
        "enable_http_worker_reuseport", "enable_kv_cache_sharding", "enable_megamoe_for_layernorm_sp",
        "enable_nvidia_megakernel", "enable_paged_experts", "enable_return_aux_hidden_states", "enable_watermark",
        "paged_experts_num_resident", "prefill_decode_interval_min_bs", "qsa_indexer_dtype",
        "return_aux_hidden_state_layer_ids", "speculative_enable_w4a4_mxfp4_megamoe",
        "speculative_use_block_verification", "unified_cache_external_linker_config", "watermark_config",
        "watermark_context_window", "watermark_default_enabled", "watermark_enforce_all", "watermark_key",
        "watermark_key_b", "watermark_max_probability", "watermark_mixing_probability",
    }),
    "0.5.22": frozenset({
        "aux_hidden_state_capture", "cuda_graph_tc_compiler", "enable_amd_monokernel",
        "enable_http_worker_reuseport", "enable_megamoe_for_layernorm_sp", "enable_nvidia_megakernel",
        "enable_paged_experts", "enable_return_aux_hidden_states", "paged_experts_num_resident",
        "prefill_decode_interval_min_bs", "return_aux_hidden_state_layer_ids",
        "unified_cache_external_linker_config",
    }),
    "0.5.23": frozenset({"cuda_graph_tc_compiler", "speculative_skip_dp_mlp_sync"}),
}

KV_BYTES: frozenset[str] = frozenset({
    # Weights and model config: which weights, at which precision, read through which config.
    "dtype",                          # weight/activation dtype (auto, bf16, fp16, fp32)
    "quantization",                   # weight (and activation) quantization method
    "kv_cache_dtype",                 # dtype the KV pool stores (fp8/fp4 recipes)
    "load_format",                    # dummy/remote weights are not the files; bitsandbytes/layered quantize
    "model_loader_extra_config",      # loader JSON; may merge a QLoRA adapter (qlora_adapter_name_or_path)
    "revision",                       # hub revision that was loaded
    "json_model_override_args",       # overrides the model config (rope scaling, heads, layers, ...)
    "model_impl",                     # another model implementation (SGLang/Transformers/MindSpore), not a kernel
    "model_config_parser",            # hf vs mistral parser: another config from the same files
    "trust_remote_code",              # the repository's own config/model code instead of the built-in one
    "context_length",                 # raises a draft model's max_position_embeddings (length-dependent rope)
    "modelopt_quant", "quantize_and_serve",  # ModelOpt quantizes the weights online
    "enable_tf32_matmul",             # fp32 matmuls at TF32 precision: a precision change, not a kernel
    # Bit-exact modes: their promise (same bits with or without a cache hit) breaks on KV from other kernels.
    "enable_deterministic_inference", "rl_on_policy_target",  # batch-invariant ops / trainer-matching numerics
    # Parallel layout: which heads, tokens or layers of a page a rank holds.
    "tp_size",                        # attention heads shard (KV heads / attn_tp_size)
    "attn_dp_size", "attn_cp_size",   # attn_tp_size = tp_size / (attn_dp_size * attn_cp_size): the head shard
    "enable_dp_attention", "dwdp_size",  # resolve into attn_dp_size (deprecated spelling; DWDP forces it)
    "dcp_size",                       # decode context parallel: a page's tokens interleaved across ranks
    "pp_size",                        # layers split across pipeline stages
    "enable_kv_cache_sharding",       # pages sharded across the group that replicated them
    "enable_dsa_cache_layer_split",   # DSA KV/indexer cache layers split across CP ranks
    "enable_scattered_sconv",         # shards the short-convolution state cache across TP ranks
    # Pool contents and layout.
    "c128_page_size",                 # physical page of the NPU DSV4 C128 compressed pool
    "disable_hybrid_swa_memory",      # SWA layers kept in the full pool for every token, not a window pool
    "enable_page_major_kv_layout", "enable_unified_memory",  # one page-major buffer of all layers' KV/state
    "enable_encoder_swa_bounded_replay",  # caches main KV + indexer keys only; SWA windows rebuilt
    "enable_decoder_swa_bounded_replay",  # SWA replay, "not numerically equivalent to full prefill"
    "mamba_ssm_dtype",                # dtype of the SSM state (bf16/fp16/fp32: same size, other bits)
    "enable_int8_mamba_checkpoint",   # radix-cached Mamba states stored in int8
    "qsa_indexer_dtype",              # dtype of the QSA indexer cache (Qwen4-Exp)
    "enable_deepseek_v4_fp4_indexer", # FP4 DeepSeek-V4 indexer cache and its norm weights
    "dsv4_attn_backend",              # trtllm switches DSV4 SWA/compressed pools to a 512-dim FP8 layout
    "kv_canary", "kv_canary_real_data",  # splice canary head/tail buffers into the pool's buffer list
    # Compute precision: activations or attention inputs quantized differently.
    "dsv4_prefill_backend",           # flashmla_sparse_q8: prefill attention with 8-bit Q and KV
    "prefill_kv_cache_dequant_dtype", # nvfp4 KV re-quantized to an FP8 workspace for prefill attention
    "enable_w4a4_mxfp4_megamoe",      # MXFP4 activations (W4A4) instead of FP8 (W4A8)
    "flashinfer_mxfp4_moe_precision", # bf16 vs fp8 activations in MXFP4 MoE
    "deepep_dispatcher_output_dtype", "flashinfer_a2a_dispatch_type",  # MoE activations dispatched quantized
    "enable_quant_communications",    # INT8-quantized TP all-reduce (lossy)
    "enable_megamoe_for_layernorm_sp",  # MegaMoE prefill, BF16-excluded layers included
    "enforce_shared_experts_fusion",  # on Quark MXFP4 checkpoints quantizes the BF16 shared expert
    "enable_waterfill",               # implies enforce_shared_experts_fusion
    "kt_method",                      # quantization of CPU-run experts (AMXINT4, ...)
    "kt_num_gpu_experts",             # which experts run from GPU weights vs the CPU-quantized copy
    "kt_max_deferred_experts_per_token",  # deferred experts' outputs join a later layer
    # What the model computes.
    "forward_hooks",                  # hooks may replace module outputs (the hook code is not hashed)
    "enable_hisparse", "hisparse_config",  # sparse top-k attention (algorithm, top_k)
    "enable_mis",                     # multi-item scoring mask: items do not attend to each other
    "enable_precise_embedding_interpolation",  # corner-aligned resize of vision position embeddings
    # Image preprocessing: image block ids may come from a raw-media hash (caller mm_hashes), not pixels.
    "mm_process_config", "image_processor_backend", "disable_fast_image_processor",
    "weight_cache_mode",              # client: weights from a daemon's memory, maybe older than the files
    # Draft model and its pools.
    "speculative_algorithm",          # whether a draft pool exists and what fills it (EAGLE/EAGLE3/MTP/DFLASH)
    "speculative_draft_model_revision",  # draft hub revision
    "speculative_draft_load_format",  # draft weights (dummy/remote are not the files)
    "speculative_draft_model_quantization",  # draft weight quantization
    "_speculative_draft_quantization_explicitly_set",  # explicit vs inherited draft quantization load differently
    "speculative_draft_kv_cache_dtype",  # draft pool dtype
    "speculative_draft_window_size", "speculative_draft_sink_size",  # draft attention window: deeper draft KV
    "enable_multi_layer_eagle", "speculative_num_steps",  # multi-layer EAGLE: one draft runner/pool per step
    "speculative_enable_w4a4_mxfp4_megamoe",  # draft MoE activations MXFP4 vs FP8
})

KV_FILES: frozenset[str] = frozenset({
    # Hashed by content: the same bytes under another path or mtime are the same identity.
    "model_path",                     # weights, config and the files next to them (local dir or hub id)
    "tokenizer_path",                 # tokenizer files (default: model_path); a tokenizer change is a new model
    "quantization_param_path",        # FP8 k_scale/v_scale that SGLang divides K/V by
    "speculative_draft_model_path",   # draft model weights/config: the draft pool's KV
    "lora_paths",                     # adapters (their names also seed extra_key via uuid5(name, path))
    "uno_lora_path",                  # UNO draft LoRA checkpoint
    "modelopt_checkpoint_restore_path",  # a saved ModelOpt-quantized checkpoint loaded instead of quantizing
    "rl_quant_profile",               # FlashRL quantization profile (load_format flash_rl)
    "kt_weight_path",                 # quantized expert weights run on CPU (ktransformers)
    "decrypted_config_file", "decrypted_draft_config_file",  # replace config.json of the model / draft
})

NAMESPACE: frozenset[str] = frozenset({
    "served_model_name",              # names the shared tier's objects and the router's model
    "page_size",                      # tokens per block: another hash chain of block ids
    "dp_size",                        # replicas (resolved): same bytes, events per dp rank
    "kv_events_config",               # topic/endpoint; format=dynamo publishes extra_key-namespaced hashes
    "elastic_ep_backend",             # appends elastic_ep_size=N to every request's extra_key
})

NEITHER: frozenset[str] = frozenset({
    # Older releases only: torch.compile's backend for captured graphs (0.5.21; a kernel choice), skipping the DP
    # MLP sync of speculative steps (0.5.21, 0.5.22; scheduling).
    "cuda_graph_tc_compiler", "speculative_skip_dp_mlp_sync",
    # Tokenizer and detokenizer processes: change token ids at most, and ids name blocks (no wrong KV).
    "tokenizer_mode", "tokenizer_backend", "tokenizer_worker_num", "detokenizer_worker_num", "skip_tokenizer_init",
    "enable_dynamic_batch_tokenizer", "dynamic_batch_tokenizer_batch_size", "dynamic_batch_tokenizer_batch_timeout",
    "enable_tokenizer_batch_encode", "disable_tokenizer_batch_decode",
    # HTTP/gRPC serving, security, API behaviour, templates (they change the prompt's ids, not KV of ids).
    "host", "port", "fastapi_root_path", "smg_grpc_mode", "grpc_mode", "grpc_port", "grpc_worker_threads", "sidecar",
    "sidecar_args", "skip_server_warmup", "warmups", "enable_http2", "http2_max_concurrent_streams",
    "http2_initial_connection_window_size", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_keyfile_password",
    "enable_ssl_refresh", "api_key", "admin_api_key", "chat_template", "trust_request_chat_template",
    "hf_chat_template_name", "completion_template", "file_storage_path", "enable_cache_report", "return_input_ids",
    "return_output_ids", "reasoning_parser", "default_chat_template_kwargs", "strip_thinking_cache",
    "enable_strict_thinking", "tool_call_parser", "tool_server", "sampling_defaults", "asr_max_buffer_seconds",
    "asr_max_concurrent_sessions", "preferred_sampling_params", "allow_auto_truncate", "stream_interval",
    "batch_notify_size", "stream_response_default_include_usage", "incremental_streaming_output",
    "enable_streaming_session", "constrained_json_whitespace_pattern", "constrained_json_disable_any_whitespace",
    "constrained_json_max_whitespace_cnt", "enable_response_store", "grpc_response_timeout_secs",
    "enable_http_worker_reuseport",
    # weight_version is a reported label (updates re-key the identity themselves).
    "weight_version",
    # Model loading mechanics: how the same files get loaded, where from, and checks on them.
    "is_embedding",  # a CausalLM used for embeddings runs the same causal layers; only pooling differs
    "modelopt_checkpoint_save_path", "modelopt_export_path", "startup_weight_load_mode", "custom_weight_loader",
    "weight_loader_disable_mmap", "weight_loader_prefetch_checkpoints", "weight_loader_prefetch_num_threads",
    "weight_loader_drop_cache_after_load", "remote_instance_weight_loader_seed_instance_ip",
    "remote_instance_weight_loader_seed_instance_service_port",
    "remote_instance_weight_loader_send_weights_group_ports",
    "remote_instance_weight_loader_backend", "remote_instance_weight_loader_start_seed_via_transfer_engine",
    "engine_info_bootstrap_port", "modelexpress_config", "download_dir", "model_checksum", "delete_ckpt_after_loading",
    "checkpoint_engine_wait_weights_before_ready", "weight_cache_socket", "weight_cache_timeout",
    "random_seed",  # sampling only: dummy weights use a fixed seed (1234)
    # Multimodal plumbing: transport, caches of identical embeddings, limits, encoder kernels and parallelism.
    "enable_multimodal", "mm_attention_backend", "enable_broadcast_mm_inputs_process", "enable_prefix_mm_cache",
    "mm_enable_dp_encoder", "mm_processor_worker_num", "mm_io_worker_num", "allowed_media_domains",
    "media_url_max_file_size_mb", "mm_preprocess_cache_size_mb", "trust_mm_content_hashes",
    "limit_mm_data_per_request", "enable_mm_global_cache", "mm_global_cache_backend", "mm_feature_transport",
    # Outputs, logits and sampling: after the KV is written (fp32 LM head, hidden states, watermarks).
    "enable_fp32_lm_head", "enable_memory_saver", "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup",
    "enable_custom_logit_processor", "enable_return_hidden_states", "return_hidden_states_mode",
    "enable_return_routed_experts", "enable_return_indexer_topk", "sampling_mask_max_tokens",
    "disable_outlines_disk_cache", "enable_watermark", "watermark_config", "watermark_key", "watermark_key_b",
    "watermark_context_window", "watermark_mixing_probability", "watermark_max_probability",
    "watermark_default_enabled", "watermark_enforce_all", "enable_return_aux_hidden_states",
    "aux_hidden_state_capture", "return_aux_hidden_state_layer_ids",
    # Scheduling and pool sizes: when and how much, not what a page holds.
    "mem_fraction_static", "max_running_requests", "max_queued_requests", "max_total_tokens", "chunked_prefill_size",
    "prefill_decode_interval", "enable_dynamic_chunking", "max_prefill_tokens", "prefill_max_requests",
    "schedule_policy", "enable_priority_scheduling", "disable_priority_preemption", "default_priority_value",
    "abort_on_priority_when_disabled", "schedule_low_priority_values_first",
    "priority_scheduling_preemption_threshold", "retraction_policy", "schedule_conservativeness",
    "swa_full_tokens_ratio", "prefill_only_disable_kv_cache", "disable_chunked_prefix_cache",
    "disable_overlap_schedule", "num_continuous_decode_steps", "scheduler_recv_interval", "enable_mixed_chunk",
    "max_mamba_cache_size", "mamba_full_memory_ratio", "enable_prefill_delayer", "prefill_delayer_max_delay_passes",
    "prefill_delayer_token_usage_low_watermark", "prefill_delayer_forward_passes_buckets",
    "prefill_delayer_wait_seconds_buckets", "prefill_delayer_queue_min_ratio", "prefill_delayer_max_delay_ms",
    "min_free_slots_delay", "_swa_full_tokens_ratio_explicitly_set", "swa_prefix_tails",
    "prefill_decode_interval_min_bs", "enable_two_batch_overlap", "enable_single_batch_overlap",
    "tbo_token_distribution_threshold", "dllm_fdfo",
    # Diffusion-LM decoding strategy: which tokens get generated, not the KV of given ids.
    "dllm_algorithm", "dllm_algorithm_config",
    # Which cache, its tiers and eviction (other caches' own settings, and this library's seam).
    "radix_eviction_policy", "radix_eviction_policy_config", "disable_radix_cache", "enable_session_radix_cache",
    "radix_cache_backend", "enable_hierarchical_cache", "hicache_host_memory_mode", "hicache_ratio", "hicache_size",
    "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout", "hicache_storage_backend",
    "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config",
    "hicache_storage_prefetch_retry_poll_interval", "hicache_storage_prefetch_retry_max_attempts",
    "enable_unified_cache_external_linker", "unified_cache_external_linker_backend", "enable_lmcache",
    "lmcache_config_file", "enable_flexkv", "flexkv_config_file", "_radix_eviction_policy_explicitly_set",
    "hicache_host_memory_fraction", "enable_linker_mla_dedup", "unified_cache_external_linker_config",
    # Mamba/linear attention: kernels, rounding within one ulp, and which positions keep a state.
    "mamba_backend", "mamba_max_states_per_path", "enable_mamba_cache_stochastic_rounding",
    "mamba_cache_philox_rounds", "mamba_radix_cache_strategy", "uses_mamba_radix_cache", "mamba_track_interval",
    "int8_mamba_ckpt_size", "linear_attn_backend", "linear_attn_decode_backend", "linear_attn_prefill_backend",
    "linear_attn_verify_backend", "enable_linear_replayssm", "linear_replayssm_cache_len",
    "enable_linear_replayssm_spec",
    # Distributed setup and parallelism that leaves each rank's KV as it is: prefill CP all-gathers full KV
    # (zigzag.materialize_full_kv); CP decode attention TP slices query heads of a replicated MLA latent; MoE,
    # LM-head, MLP and expert parallelism shard weights only (reduction order within kernel tolerance).
    "nccl_port", "dist_timeout", "dist_init_addr", "gated_launch_port", "nnodes", "node_rank",
    "pp_max_micro_batch_size", "pp_async_batch_depth", "load_balance_method", "moe_dp_size", "dcp_comm_backend",
    "dcp_replicate_q_proj", "enable_prefill_cp", "cp_strategy", "enable_cp_decode_attn_tp",
    "enable_dp_attention_local_control_broadcast", "enable_dp_lm_head", "enable_tp_lm_head_all_to_all",
    "enable_attn_tp_input_scattered", "enable_shared_experts_attn_tp", "shared_experts_tp_size",
    "enable_dense_mlp_attn_tp", "enable_layernorm_sp", "disable_attn_tp_gather", "enable_p2p_check", "ep_size",
    "moe_dense_tp_size", "ep_join_rank_offset", "elastic_ep_initial_size", "max_ep_size",
    "enable_cp_tp_group_sharing",  # derived from enable_prefill_cp, attn_cp_size and the architecture
    # Device and process management (the pool's own layout on a device is recorded from the pool).
    "device", "base_gpu_id", "gpu_id_step", "mlx_enable_sampling", "watchdog_timeout", "soft_watchdog_timeout",
    "sleep_on_idle", "use_ray", "custom_sigquit_handler", "numa_node", "gc_threshold",
    # Logging, metrics, tracing, debug dumps.
    "log_level", "log_level_http", "log_requests", "log_requests_level", "log_requests_format", "log_requests_target",
    "uvicorn_access_log_exclude_prefixes", "crash_dump_folder", "show_time_cost", "enable_metrics",
    "smg_http_sidecar_port", "enable_mfu_metrics", "enable_metrics_for_all_schedulers",
    "load_snapshot_publish_interval", "tokenizer_metrics_custom_labels_header",
    "tokenizer_metrics_allowed_custom_labels", "extra_metric_labels", "bucket_time_to_first_token",
    "bucket_inter_token_latency", "bucket_e2e_request_latency", "prompt_tokens_buckets", "generation_tokens_buckets",
    "gc_warning_threshold_secs", "decode_log_interval", "enable_request_time_stats_logging", "load_publish_endpoint",
    "enable_forward_pass_metrics", "forward_pass_metrics_worker_id", "forward_pass_metrics_ipc_name",
    "enable_trace", "trace_modules", "otlp_traces_endpoint", "export_metrics_to_file", "export_metrics_to_file_dir",
    "stat_loggers", "kv_canary_sweep_interval", "debug_tensor_dump_output_folder", "debug_tensor_dump_layers",
    "debug_tensor_dump_input_file", "msprobe_dump_config", "otlp_service_name",
    # Numerics-only kernel choices (same math, same precision, within kernel tolerance): attention, GEMM,
    # sampling, grammar, fused and mega kernels. Like every KV cache, the same model's KV from another kernel
    # is the same KV. Backends that need another KV dtype or page size get it through kv_cache_dtype/page_size.
    "attention_backend", "decode_attention_backend", "enable_lean_attention", "prefill_attention_backend",
    "sampling_backend", "grammar_backend", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend", "bf16_gemm_backend",
    "dsa_prefill_backend", "dsa_decode_backend", "dsa_paged_mqa_logits_backend", "dsa_topk_backend",
    "disable_flashinfer_autotune", "flashinfer_autotune_skip_ops", "triton_attention_reduce_in_fp32",
    "triton_attention_num_kv_splits", "triton_attention_split_tile_size", "flashinfer_mla_disable_ragged",
    "enable_fused_qk_norm_rope", "enable_amd_monokernel", "dsa_triton_union", "enable_dsa_fused_indexer",
    "enable_nvidia_megakernel",
    # CUDA graphs and torch.compile: the same kernels captured.
    "cuda_graph_config", "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "cuda_graph_max_bs_decode",
    "cuda_graph_max_bs_prefill", "cuda_graph_bs_decode", "cuda_graph_bs_prefill", "cuda_graph_prefill_max_context",
    "disable_prefill_cuda_graph", "disable_decode_cuda_graph", "disable_cuda_graph", "disable_cuda_graph_padding",
    "enable_profile_cuda_graph", "enable_cudagraph_gc", "debug_cuda_graph", "enable_torch_compile",
    "enable_torch_compile_debug_mode", "torch_compile_max_bs", "cuda_graph_max_seq_len_prefill",
    # Collectives: exact reductions in another order (INT8-quantized communication is KV_BYTES).
    "enable_layerwise_nvtx_marker", "enable_nccl_nvls", "enable_symm_mem", "disable_custom_all_reduce",
    "enable_mscclpp", "enable_torch_symm_mem", "pre_warm_nccl", "boundary_reduction",
    "enable_flashinfer_allreduce_fusion", "enforce_disable_flashinfer_allreduce_fusion",
    "flashinfer_allreduce_fusion_backend", "enable_aiter_allreduce_fusion", "disable_aiter_allreduce_fusion_in_prefill",
    "disable_aiter_allreduce_fusion_in_decode",
    # MoE runners, all-to-all, expert placement and balancing: where experts run, not at which precision.
    "enable_fused_moe_sum_all_reduce", "moe_a2a_backend", "deepep_v2_mode", "moe_runner_backend", "deepep_mode",
    "fuseep_mode", "ep_num_redundant_experts", "ep_dispatch_algorithm", "init_expert_location", "enable_eplb",
    "eplb_algorithm", "eplb_rebalance_num_iterations", "eplb_rebalance_layers_per_chunk",
    "eplb_min_rebalancing_utilization_threshold", "expert_distribution_recorder_mode",
    "expert_distribution_recorder_buffer_size", "expert_balancedness_report_mode", "deepep_config",
    "enable_elastic_expert_backup", "mooncake_ib_device", "ep_join_mode", "elastic_ep_scale_timeout",
    "disable_flashinfer_cutlass_moe_fp4_allgather", "disable_shared_experts_fusion", "kt_cpuinfer",
    "kt_threadpool_count", "enable_paged_experts", "paged_experts_num_resident",
    # Weight and embedding offload: where the same weights live.
    "cpu_offload_gb", "offload_group_size", "offload_num_in_group", "offload_prefetch_step", "offload_mode",
    "ple_offload_embedding", "ple_offload_backend", "ple_offload_dir",
    # Speculation shape, acceptance and n-gram drafting: draft KV is computed per accepted token from the target's
    # hidden states (DFLASH materializes it), whatever the tree shape; the token map prunes the draft LM head only.
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_dflash_block_size",
    "speculative_dspark_block_size", "speculative_dspark_sps_table_path", "speculative_dspark_confidence_sts_path",
    "speculative_dspark_align_verify_tokens_to_graph_tier", "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc", "speculative_use_rejection_sampling", "speculative_token_map",
    "speculative_attention_mode", "speculative_draft_attention_backend", "speculative_dsa_topk_backend",
    "speculative_moe_runner_backend", "speculative_moe_a2a_backend", "speculative_adaptive",
    "speculative_adaptive_config", "spec_trace_dir", "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type", "speculative_ngram_max_trie_depth",
    "speculative_ngram_capacity", "speculative_ngram_external_corpus_path", "speculative_ngram_external_sam_budget",
    "speculative_ngram_external_corpus_max_tokens", "speculative_domino_candidate_pool_size",
    "speculative_boundary_reduction", "speculative_use_block_verification",
    # PD/encoder disaggregation and decoupled speculation: which process computes or receives the same KV.
    "decoupled_spec_bind_endpoint", "decoupled_spec_connect_endpoints", "decoupled_spec_rank", "decoupled_spec_role",
    "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
    "disaggregation_ib_device", "disaggregation_decode_enable_radix_cache",
    "disaggregation_decode_enable_offload_kvcache", "disaggregation_decode_retraction_backup",
    "num_reserved_decode_tokens", "disaggregation_decode_extra_slots", "disaggregation_decode_polling_interval",
    "optimistic_prefill_attempts", "encoder_only", "language_only", "language_model_only", "encoder_transfer_backend",
    "encoder_urls", "encoder_bootstrap_port", "encoder_register_urls", "enable_adaptive_dispatch_to_encoder",
    "enable_pdmux", "pdmux_config_path", "sm_group_num", "disaggregation_enable_kv_checksum", "enable_pd_role_switch",
    "disaggregation_decode_host_receive_threshold", "disaggregation_decode_allocation_policy",
    # LoRA serving: pool sizes, kernels, loading; adapters must fit lora_target_modules or loading fails, and a
    # request's adapter is in its extra_key (lora_paths is KV_FILES).
    "enable_lora", "enable_lora_overlap_loading", "max_lora_rank", "lora_target_modules", "max_loaded_loras",
    "max_loras_per_batch", "lora_eviction_policy", "lora_backend", "max_lora_chunk_size", "experts_shared_outer_loras",
    "lora_use_virtual_experts", "lora_strict_loading", "lora_drain_wait_threshold",
})
