"""The fields and option strings of `trl-federated run`'s parser, for `flags.check_before_import`.
Written by `python -m trl_federated.arguments.parsing`; tests/test_cli.py checks it against the parser."""

VERSIONS = ('1.16.0', '5.24.0')  # TRL's and transformers'
FIELDS = tuple("""
accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2 adam_epsilon
aggregation aggregation_args algorithm attn_implementation auto_find_batch_size average_tokens_across_devices
batch_eval_metrics benchmark_seed benchmark_size benchmark_source beta bf16 bf16_full_eval bnb_4bit_quant_storage
bnb_4bit_quant_type cache_implementation cast_lm_head_to_fp32 chat_template_kwargs client_timeout data_seed
dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor dataset_config dataset_name
dataset_test_split dataset_train_split ddp_backend ddp_broadcast_buffers ddp_bucket_cap_mb
ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed delta dirichlet_alpha disable_dropout
disable_tqdm do_eval do_predict do_train dp_adaptive_clipping dp_clip_norm dp_clip_norm_lr dp_clipped_count_stddev
dp_max_epsilon dp_noise_multiplier dp_noise_seed dp_record_clip_norm dp_record_epsilon dp_record_noise_multiplier
dp_record_reward_noise_multiplier dp_reward_noise_multiplier dp_target_delta dp_target_quantile
ds3_gather_for_generation dtype enable_jit_checkpoint entropy_coef entropy_coef_delta entropy_coef_max
entropy_coef_min entropy_target epsilon epsilon_high equal_partition_sizes eval_accumulation_steps eval_delay
eval_do_concat_batches eval_every eval_initial eval_on_start eval_reward_funcs eval_steps eval_strategy
eval_use_gather_object fast_generation federation_round fedprox_mu fp16 fp16_full_eval fraction_evaluate
fraction_train fsdp fsdp_config full_determinism generation_batch_size generation_dtype generation_kwargs
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs greater_is_better help
hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip
importance_sampling_level include_for_metrics include_num_input_tokens_seen label_names label_smoothing_factor
labels_per_client learning_rate length_column_name liger_kernel_config load_best_model_at_end load_in_4bit
load_in_8bit local_rank local_steps log_completions log_completions_hub_repo log_level log_level_replica
log_multimodal log_on_each_node log_unique_prompts logging_first_step logging_nan_inf_filter logging_steps
logging_strategy lora_aggregation lora_alpha lora_dropout lora_modules_to_save lora_r lora_target_modules
lora_target_parameters lora_task_type loss_type lr_scheduler_kwargs lr_scheduler_type mask_truncated_completions
max_client_samples max_completion_length max_eval_samples max_grad_norm max_pixels max_steps
max_tool_calling_iterations metric_for_best_model min_clients_per_round min_evaluate_clients min_p
min_partition_size min_train_clients model_init_kwargs model_name_or_path model_revision multi_objective_aggregation
neftune_noise_alpha node_wait_timeout num_clients num_completions_to_print num_generations num_generations_eval
num_iterations num_rounds num_train_epochs off_policy_mask_threshold optim optim_args optim_target_modules
output_dir overwrite_output_dir pad_to_multiple_of parallelism_config partition_column per_device_eval_batch_size
per_device_train_batch_size prediction_loss_only project push_to_hub recompute_gated_mlp ref_model_mixup_alpha
ref_model_sync_steps remove_unused_columns repetition_penalty report_to restore_callback_states_from_checkpoint
resume_allow_changes resume_from_checkpoint reward_funcs reward_model_name_or_path reward_weights reward_window
robust_aggregation robust_num_malicious robust_num_selected robust_trim_fraction router_aux_loss_coef rpg_eps
rpg_gain rpg_h_max rpg_iota rpg_lambda_anneal rpg_lambda_base rpg_noise_threshold rpg_sigma_max rpg_sigma_min
rpg_signal rpg_signal_items rpg_tau_max rpg_tau_min run_name sapo_temperature_neg sapo_temperature_pos
save_every_round save_on_each_node save_only_model save_steps save_strategy save_total_limit scaffold_correction
scale_rewards seed server_beta1 server_beta2 server_bias_correction server_epsilon server_learning_rate
server_optimizer server_optimizer_args shared_prefix shuffle_dataset skip_memory_metrics skip_zero_advantage_rows
steps_per_generation sync_ref_model temperature tf32 top_entropy_quantile top_k top_p torch_compile
torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_sampling_strategy trainer_class trainer_config_class transfer_dtype
transformers_continuous_batching_config trust_remote_code update_norm_action update_norm_bound use_adaptive_entropy
use_bias_correction_kl use_bnb_nested_quant use_cache use_cpu use_dora use_liger_kernel use_peft use_rslora
use_transformers_continuous_batching use_transformers_paged use_vllm vespo_k_neg vespo_k_pos vespo_lambda_neg
vespo_lambda_pos vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_importance_sampling_cap
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min vllm_importance_sampling_correction
vllm_importance_sampling_mode vllm_max_model_length vllm_mode vllm_model_impl vllm_server_base_url vllm_server_host
vllm_server_port vllm_server_timeout vllm_structured_outputs_regex vllm_tensor_parallel_size warmup_steps
weight_decay
""".split())
OPTIONS = tuple("""
--accelerator-config --accelerator_config --activation-checkpointing --activation-checkpointing-kwargs
--activation_checkpointing --activation_checkpointing_kwargs --adam-beta1 --adam-beta2 --adam-epsilon --adam_beta1
--adam_beta2 --adam_epsilon --aggregation --aggregation-args --aggregation_args --algorithm --attn-implementation
--attn_implementation --auto-find-batch-size --auto_find_batch_size --average-tokens-across-devices
--average_tokens_across_devices --batch-eval-metrics --batch_eval_metrics --benchmark-seed --benchmark-size
--benchmark-source --benchmark_seed --benchmark_size --benchmark_source --beta --bf16 --bf16-full-eval
--bf16_full_eval --bnb-4bit-quant-storage --bnb-4bit-quant-type --bnb_4bit_quant_storage --bnb_4bit_quant_type
--cache-implementation --cache_implementation --cast-lm-head-to-fp32 --cast_lm_head_to_fp32 --chat-template-kwargs
--chat_template_kwargs --client-timeout --client_timeout --config --data-seed --data_seed --dataloader-drop-last
--dataloader-in-order --dataloader-multiprocessing-context --dataloader-num-workers --dataloader-persistent-workers
--dataloader-pin-memory --dataloader-prefetch-factor --dataloader_drop_last --dataloader_in_order
--dataloader_multiprocessing_context --dataloader_num_workers --dataloader_persistent_workers
--dataloader_pin_memory --dataloader_prefetch_factor --dataset-config --dataset-name --dataset-test-split
--dataset-train-split --dataset_config --dataset_name --dataset_test_split --dataset_train_split --ddp-backend
--ddp-broadcast-buffers --ddp-bucket-cap-mb --ddp-find-unused-parameters --ddp-static-graph --ddp-timeout
--ddp_backend --ddp_broadcast_buffers --ddp_bucket_cap_mb --ddp_find_unused_parameters --ddp_static_graph
--ddp_timeout --debug --deepspeed --delta --dirichlet-alpha --dirichlet_alpha --disable-dropout --disable-tqdm
--disable_dropout --disable_tqdm --do-eval --do-predict --do-train --do_eval --do_predict --do_train
--dp-adaptive-clipping --dp-clip-norm --dp-clip-norm-lr --dp-clipped-count-stddev --dp-max-epsilon
--dp-noise-multiplier --dp-noise-seed --dp-record-clip-norm --dp-record-epsilon --dp-record-noise-multiplier
--dp-record-reward-noise-multiplier --dp-reward-noise-multiplier --dp-target-delta --dp-target-quantile
--dp_adaptive_clipping --dp_clip_norm --dp_clip_norm_lr --dp_clipped_count_stddev --dp_max_epsilon
--dp_noise_multiplier --dp_noise_seed --dp_record_clip_norm --dp_record_epsilon --dp_record_noise_multiplier
--dp_record_reward_noise_multiplier --dp_reward_noise_multiplier --dp_target_delta --dp_target_quantile
--ds3-gather-for-generation --ds3_gather_for_generation --dtype --enable-jit-checkpoint --enable_jit_checkpoint
--entropy-coef --entropy-coef-delta --entropy-coef-max --entropy-coef-min --entropy-target --entropy_coef
--entropy_coef_delta --entropy_coef_max --entropy_coef_min --entropy_target --epsilon --epsilon-high --epsilon_high
--equal-partition-sizes --equal_partition_sizes --eval-accumulation-steps --eval-delay --eval-do-concat-batches
--eval-every --eval-initial --eval-on-start --eval-reward-funcs --eval-steps --eval-strategy
--eval-use-gather-object --eval_accumulation_steps --eval_delay --eval_do_concat_batches --eval_every --eval_initial
--eval_on_start --eval_reward_funcs --eval_steps --eval_strategy --eval_use_gather_object --fast-generation
--fast_generation --federation-round --federation_round --fedprox-mu --fedprox_mu --fp16 --fp16-full-eval
--fp16_full_eval --fraction-evaluate --fraction-train --fraction_evaluate --fraction_train --fsdp --fsdp-config
--fsdp_config --full-determinism --full_determinism --generation-batch-size --generation-dtype --generation-kwargs
--generation_batch_size --generation_dtype --generation_kwargs --gradient-accumulation-steps
--gradient-checkpointing --gradient-checkpointing-kwargs --gradient_accumulation_steps --gradient_checkpointing
--gradient_checkpointing_kwargs --greater-is-better --greater_is_better --help --hub-always-push --hub-model-id
--hub-private-repo --hub-revision --hub-strategy --hub-token --hub_always_push --hub_model_id --hub_private_repo
--hub_revision --hub_strategy --hub_token --ignore-data-skip --ignore_data_skip --importance-sampling-level
--importance_sampling_level --include-for-metrics --include-num-input-tokens-seen --include_for_metrics
--include_num_input_tokens_seen --label-names --label-smoothing-factor --label_names --label_smoothing_factor
--labels-per-client --labels_per_client --learning-rate --learning_rate --length-column-name --length_column_name
--liger-kernel-config --liger_kernel_config --load-best-model-at-end --load-in-4bit --load-in-8bit
--load_best_model_at_end --load_in_4bit --load_in_8bit --local-rank --local-steps --local_rank --local_steps
--log-completions --log-completions-hub-repo --log-level --log-level-replica --log-multimodal --log-on-each-node
--log-unique-prompts --log_completions --log_completions_hub_repo --log_level --log_level_replica --log_multimodal
--log_on_each_node --log_unique_prompts --logging-first-step --logging-nan-inf-filter --logging-steps
--logging-strategy --logging_first_step --logging_nan_inf_filter --logging_steps --logging_strategy
--lora-aggregation --lora-alpha --lora-dropout --lora-modules-to-save --lora-r --lora-target-modules
--lora-target-parameters --lora-task-type --lora_aggregation --lora_alpha --lora_dropout --lora_modules_to_save
--lora_r --lora_target_modules --lora_target_parameters --lora_task_type --loss-type --loss_type
--lr-scheduler-kwargs --lr-scheduler-type --lr_scheduler_kwargs --lr_scheduler_type --mask-truncated-completions
--mask_truncated_completions --max-client-samples --max-completion-length --max-eval-samples --max-grad-norm
--max-pixels --max-steps --max-tool-calling-iterations --max_client_samples --max_completion_length
--max_eval_samples --max_grad_norm --max_pixels --max_steps --max_tool_calling_iterations --metric-for-best-model
--metric_for_best_model --min-clients-per-round --min-evaluate-clients --min-p --min-partition-size
--min-train-clients --min_clients_per_round --min_evaluate_clients --min_p --min_partition_size --min_train_clients
--model-init-kwargs --model-name-or-path --model-revision --model_init_kwargs --model_name_or_path --model_revision
--multi-objective-aggregation --multi_objective_aggregation --neftune-noise-alpha --neftune_noise_alpha
--no-average-tokens-across-devices --no-dataloader-in-order --no-dataloader-pin-memory
--no-ds3-gather-for-generation --no-eval-do-concat-batches --no-eval-initial --no-gradient-checkpointing
--no-log-multimodal --no-log-on-each-node --no-logging-nan-inf-filter --no-mask-truncated-completions
--no-save-every-round --no-shuffle-dataset --no-skip-memory-metrics --no-use-bias-correction-kl
--no-vllm-importance-sampling-correction --no_average_tokens_across_devices --no_dataloader_in_order
--no_dataloader_pin_memory --no_ds3_gather_for_generation --no_eval_do_concat_batches --no_eval_initial
--no_gradient_checkpointing --no_log_multimodal --no_log_on_each_node --no_logging_nan_inf_filter
--no_mask_truncated_completions --no_save_every_round --no_shuffle_dataset --no_skip_memory_metrics
--no_use_bias_correction_kl --no_vllm_importance_sampling_correction --node-wait-timeout --node_wait_timeout
--num-clients --num-completions-to-print --num-generations --num-generations-eval --num-iterations --num-rounds
--num-train-epochs --num_clients --num_completions_to_print --num_generations --num_generations_eval
--num_iterations --num_rounds --num_train_epochs --off-policy-mask-threshold --off_policy_mask_threshold --optim
--optim-args --optim-target-modules --optim_args --optim_target_modules --output-dir --output_dir
--overwrite-output-dir --overwrite_output_dir --pad-to-multiple-of --pad_to_multiple_of --parallelism-config
--parallelism_config --partition-column --partition_column --per-device-eval-batch-size
--per-device-train-batch-size --per_device_eval_batch_size --per_device_train_batch_size --prediction-loss-only
--prediction_loss_only --project --push-to-hub --push_to_hub --recompute-gated-mlp --recompute_gated_mlp
--ref-model-mixup-alpha --ref-model-sync-steps --ref_model_mixup_alpha --ref_model_sync_steps
--remove-unused-columns --remove_unused_columns --repetition-penalty --repetition_penalty --report-to --report_to
--restore-callback-states-from-checkpoint --restore_callback_states_from_checkpoint --resume-allow-changes
--resume-from-checkpoint --resume_allow_changes --resume_from_checkpoint --reward-funcs --reward-model-name-or-path
--reward-weights --reward-window --reward_funcs --reward_model_name_or_path --reward_weights --reward_window
--robust-aggregation --robust-num-malicious --robust-num-selected --robust-trim-fraction --robust_aggregation
--robust_num_malicious --robust_num_selected --robust_trim_fraction --router-aux-loss-coef --router_aux_loss_coef
--rpg-eps --rpg-gain --rpg-h-max --rpg-iota --rpg-lambda-anneal --rpg-lambda-base --rpg-noise-threshold
--rpg-sigma-max --rpg-sigma-min --rpg-signal --rpg-signal-items --rpg-tau-max --rpg-tau-min --rpg_eps --rpg_gain
--rpg_h_max --rpg_iota --rpg_lambda_anneal --rpg_lambda_base --rpg_noise_threshold --rpg_sigma_max --rpg_sigma_min
--rpg_signal --rpg_signal_items --rpg_tau_max --rpg_tau_min --run-name --run_name --sapo-temperature-neg
--sapo-temperature-pos --sapo_temperature_neg --sapo_temperature_pos --save-every-round --save-on-each-node
--save-only-model --save-steps --save-strategy --save-total-limit --save_every_round --save_on_each_node
--save_only_model --save_steps --save_strategy --save_total_limit --scaffold-correction --scaffold_correction
--scale-rewards --scale_rewards --seed --server-beta1 --server-beta2 --server-bias-correction --server-epsilon
--server-learning-rate --server-optimizer --server-optimizer-args --server_beta1 --server_beta2
--server_bias_correction --server_epsilon --server_learning_rate --server_optimizer --server_optimizer_args
--shared-prefix --shared_prefix --shuffle-dataset --shuffle_dataset --skip-memory-metrics --skip-zero-advantage-rows
--skip_memory_metrics --skip_zero_advantage_rows --steps-per-generation --steps_per_generation --sync-ref-model
--sync_ref_model --temperature --tf32 --top-entropy-quantile --top-k --top-p --top_entropy_quantile --top_k --top_p
--torch-compile --torch-compile-backend --torch-compile-mode --torch-empty-cache-steps --torch_compile
--torch_compile_backend --torch_compile_mode --torch_empty_cache_steps --trackio-bucket-id --trackio-space-id
--trackio-static-space-id --trackio_bucket_id --trackio_space_id --trackio_static_space_id --train-sampling-strategy
--train_sampling_strategy --trainer-class --trainer-config-class --trainer_class --trainer_config_class
--transfer-dtype --transfer_dtype --transformers-continuous-batching-config
--transformers_continuous_batching_config --trust-remote-code --trust_remote_code --update-norm-action
--update-norm-bound --update_norm_action --update_norm_bound --use-adaptive-entropy --use-bias-correction-kl
--use-bnb-nested-quant --use-cache --use-cpu --use-dora --use-liger-kernel --use-peft --use-rslora
--use-transformers-continuous-batching --use-transformers-paged --use-vllm --use_adaptive_entropy
--use_bias_correction_kl --use_bnb_nested_quant --use_cache --use_cpu --use_dora --use_liger_kernel --use_peft
--use_rslora --use_transformers_continuous_batching --use_transformers_paged --use_vllm --vespo-k-neg --vespo-k-pos
--vespo-lambda-neg --vespo-lambda-pos --vespo_k_neg --vespo_k_pos --vespo_lambda_neg --vespo_lambda_pos
--vllm-enable-sleep-mode --vllm-gpu-memory-utilization --vllm-group-port --vllm-importance-sampling-cap
--vllm-importance-sampling-clip-max --vllm-importance-sampling-clip-min --vllm-importance-sampling-correction
--vllm-importance-sampling-mode --vllm-max-model-length --vllm-mode --vllm-model-impl --vllm-server-base-url
--vllm-server-host --vllm-server-port --vllm-server-timeout --vllm-structured-outputs-regex
--vllm-tensor-parallel-size --vllm_enable_sleep_mode --vllm_gpu_memory_utilization --vllm_group_port
--vllm_importance_sampling_cap --vllm_importance_sampling_clip_max --vllm_importance_sampling_clip_min
--vllm_importance_sampling_correction --vllm_importance_sampling_mode --vllm_max_model_length --vllm_mode
--vllm_model_impl --vllm_server_base_url --vllm_server_host --vllm_server_port --vllm_server_timeout
--vllm_structured_outputs_regex --vllm_tensor_parallel_size --warmup-steps --warmup_steps --weight-decay
--weight_decay -h
""".split())
