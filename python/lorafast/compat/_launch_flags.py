"""The launch parser of each verified engine release, as lorafast.compat.launch rebuilds it. Generated from the
engines' own parsers by tests/oracle/test_oracle_launch.py (which fails, and writes the new text, when they differ).

One line per argparse action, in the engine's order: the option strings the engine gives `add_argument`, then
its kind: nothing (one value), `?`/`*`/`+` (that many values), `T` store_true, `A` append, `B`
BooleanOptionalAction (adds `--no-X`), `E` vLLM's EnableDisableAction (adds `--no-X`, and `--disable-X` for
`--enable-X` or back), `h` help, `xN:Name` the engine's own action class Name, taking N values (`x:` one);
then `!` when required and `=dest` when the dest is not argparse's default. `@dest nargs` is a positional.

`FLAGS` holds each engine's oldest verified release whole; `CHANGES` each later release as (the release before
it, its edits of that table): `=N` keeps the next N lines, `-N` drops them, `+LINE` adds LINE. Read a release's
table with `lorafast.compat.launch._flag_table`.
"""

FLAGS: dict[tuple[str, str], str] = {
    ("sglang", "0.5.23"): """\
-h,--help h
--model-path,--model !
--tokenizer-path
--tokenizer-mode
--tokenizer-backend
--tokenizer-worker-num
--detokenizer-worker-num
--skip-tokenizer-init T
--load-format
--model-loader-extra-config
--trust-remote-code T
--context-length
--is-embedding T
--enable-multimodal T
--revision
--model-impl
--model-config-parser
--json-model-override-args
--dtype
--quantization
--quantization-param-path
--kv-cache-dtype
--enable-fp32-lm-head T
--modelopt-quant
--modelopt-checkpoint-restore-path
--modelopt-checkpoint-save-path
--modelopt-export-path
--quantize-and-serve T
--rl-quant-profile
--enable-tf32-matmul B
--mem-fraction-static
--max-running-requests
--max-queued-requests
--max-total-tokens
--chunked-prefill-size
--prefill-decode-interval
--enable-dynamic-chunking T
--max-prefill-tokens
--prefill-max-requests
--schedule-policy
--enable-priority-scheduling T
--disable-priority-preemption T
--default-priority-value
--abort-on-priority-when-disabled T
--schedule-low-priority-values-first T
--priority-scheduling-preemption-threshold
--retraction-policy
--schedule-conservativeness
--page-size
--c128-page-size
--swa-full-tokens-ratio
--disable-hybrid-swa-memory T
--radix-eviction-policy
--radix-eviction-policy-config
--prefill-only-disable-kv-cache T
--disable-radix-cache T
--enable-page-major-kv-layout T
--enable-unified-memory T
--disable-chunked-prefix-cache T
--disable-overlap-schedule T
--num-continuous-decode-steps
--scheduler-recv-interval
--enable-mixed-chunk T
--nccl-port
--dist-timeout
--dist-init-addr,--nccl-init-addr
--gated-launch-port
--nnodes
--node-rank
--tp-size,--tensor-parallel-size
--dcp-size,--decode-context-parallel-size
--pp-size,--pipeline-parallel-size
--pp-max-micro-batch-size
--pp-async-batch-depth
--dp-size,--data-parallel-size
--attn-dp-size,--attention-data-parallel-size
--load-balance-method
--attn-cp-size,--attention-context-parallel-size
--moe-dp-size,--moe-data-parallel-size
--dwdp-size
--dcp-comm-backend
--dcp-replicate-q-proj B
--enable-prefill-cp T
--cp-strategy
--enable-dsa-cache-layer-split T
--enable-cp-decode-attn-tp T
--enable-kv-cache-sharding T
--enable-dp-attention-local-control-broadcast T
--enable-dp-lm-head T
--enable-tp-lm-head-all-to-all B
--enable-attn-tp-input-scattered T
--enable-shared-experts-attn-tp T
--shared-experts-tp-size
--enable-dense-mlp-attn-tp T
--enable-layernorm-sp T
--disable-attn-tp-gather T
--enable-p2p-check T
--device
--base-gpu-id
--gpu-id-step
--random-seed
--mlx-enable-sampling T
--watchdog-timeout
--soft-watchdog-timeout
--sleep-on-idle T
--use-ray T
--numa-node +
--gc-threshold +
--host
--port
--fastapi-root-path
--smg-grpc-mode T
--grpc-mode T
--grpc-port
--sidecar
--sidecar-args
--skip-server-warmup T
--warmups
--enable-http2 T
--http2-max-concurrent-streams
--http2-initial-connection-window-size
--ssl-keyfile
--ssl-certfile
--ssl-ca-certs
--ssl-keyfile-password
--enable-ssl-refresh T
--api-key
--admin-api-key
--served-model-name
--weight-version
--chat-template
--trust-request-chat-template T
--hf-chat-template-name
--completion-template
--file-storage-path
--enable-cache-report T
--return-input-ids T
--return-output-ids T
--default-chat-template-kwargs
--strip-thinking-cache T
--enable-strict-thinking T
--tool-server
--sampling-defaults
--asr-max-buffer-seconds
--asr-max-concurrent-sessions
--preferred-sampling-params
--allow-auto-truncate T
--stream-interval
--batch-notify-size
--stream-response-default-include-usage T
--incremental-streaming-output T
--enable-streaming-session T
--enable-session-radix-cache T
--log-level
--log-level-http
--log-requests T
--log-requests-level
--log-requests-format
--log-requests-target +
--uvicorn-access-log-exclude-prefixes *
--crash-dump-folder
--show-time-cost T
--enable-metrics T
--smg-http-sidecar-port,--grpc-http-sidecar-port
--enable-mfu-metrics T
--enable-metrics-for-all-schedulers T
--load-snapshot-publish-interval
--tokenizer-metrics-custom-labels-header
--tokenizer-metrics-allowed-custom-labels +
--extra-metric-labels
--bucket-time-to-first-token +
--bucket-inter-token-latency +
--bucket-e2e-request-latency +
--prompt-tokens-buckets +
--generation-tokens-buckets +
--gc-warning-threshold-secs
--decode-log-interval
--enable-request-time-stats-logging T
--kv-events-config
--load-publish-endpoint
--enable-forward-pass-metrics T
--forward-pass-metrics-worker-id
--forward-pass-metrics-ipc-name
--enable-trace T
--trace-modules
--otlp-traces-endpoint
--export-metrics-to-file T
--export-metrics-to-file-dir
--constrained-json-whitespace-pattern
--constrained-json-disable-any-whitespace T
--constrained-json-max-whitespace-cnt
--attention-backend
--decode-attention-backend
--enable-lean-attention T
--prefill-attention-backend
--grammar-backend
--radix-cache-backend
--mm-attention-backend
--fp8-gemm-backend =fp8_gemm_runner_backend
--fp4-gemm-backend =fp4_gemm_runner_backend
--bf16-gemm-backend
--dsa-prefill-backend
--dsv4-prefill-backend
--dsa-decode-backend
--dsa-paged-mqa-logits-backend
--dsa-topk-backend
--disable-flashinfer-autotune T
--flashinfer-autotune-skip-ops +
--mamba-backend
--cuda-graph-config
--cuda-graph-backend-decode
--cuda-graph-backend-prefill
--cuda-graph-max-bs-decode
--cuda-graph-max-bs-prefill
--cuda-graph-bs-decode +
--cuda-graph-bs-prefill +
--cuda-graph-prefill-max-context,--context-bucket
--disable-prefill-cuda-graph T
--disable-decode-cuda-graph T
--disable-cuda-graph-padding T
--enable-profile-cuda-graph T
--enable-cudagraph-gc T
--debug-cuda-graph T
--enable-layerwise-nvtx-marker T
--enable-nccl-nvls T
--enable-symm-mem T
--triton-attention-reduce-in-fp32 T
--triton-attention-num-kv-splits
--triton-attention-split-tile-size
--flashinfer-mla-disable-ragged T
--enable-fused-qk-norm-rope B
--enable-precise-embedding-interpolation T
--enable-fused-moe-sum-all-reduce T
--enable-deepseek-v4-fp4-indexer T
--disable-custom-all-reduce T
--enable-mscclpp T
--enable-torch-symm-mem T
--enable-scattered-sconv T
--pre-warm-nccl T
--boundary-reduction
--enable-quant-communications T
--enforce-disable-flashinfer-allreduce-fusion T
--flashinfer-allreduce-fusion-backend
--enable-aiter-allreduce-fusion T
--enable-torch-compile T
--enable-torch-compile-debug-mode T
--torch-compile-max-bs
--speculative-algorithm
--uno-lora-path
--speculative-draft-model-path,--speculative-draft-model
--speculative-draft-model-revision
--speculative-draft-load-format
--speculative-num-steps
--speculative-eagle-topk
--speculative-num-draft-tokens
--speculative-dflash-block-size
--speculative-dspark-block-size
--speculative-dspark-sps-table-path
--speculative-dspark-confidence-sts-path
--speculative-dspark-align-verify-tokens-to-graph-tier T
--speculative-accept-threshold-single
--speculative-accept-threshold-acc
--speculative-use-rejection-sampling T
--speculative-token-map
--speculative-attention-mode
--speculative-draft-attention-backend
--speculative-dsa-topk-backend
--speculative-draft-kv-cache-dtype
--speculative-draft-window-size
--speculative-moe-runner-backend
--speculative-moe-a2a-backend
--speculative-enable-w4a4-mxfp4-megamoe B
--speculative-draft-model-quantization
--enable-multi-layer-eagle T
--speculative-adaptive T
--speculative-adaptive-config
--decoupled-spec-bind-endpoint
--decoupled-spec-connect-endpoints
--decoupled-spec-rank
--decoupled-spec-role
--spec-trace-dir
--speculative-ngram-min-bfs-breadth
--speculative-ngram-max-bfs-breadth
--speculative-ngram-match-type
--speculative-ngram-max-trie-depth
--speculative-ngram-capacity
--speculative-ngram-external-corpus-path
--speculative-ngram-external-sam-budget
--speculative-ngram-external-corpus-max-tokens
--ep-size,--expert-parallel-size,--ep
--moe-a2a-backend
--enable-w4a4-mxfp4-megamoe T
--deepep-v2-mode
--moe-runner-backend
--flashinfer-mxfp4-moe-precision
--deepep-mode
--fuseep-mode
--deepep-dispatcher-output-dtype
--ep-num-redundant-experts
--ep-dispatch-algorithm
--init-expert-location
--enable-eplb T
--eplb-algorithm
--eplb-rebalance-num-iterations
--eplb-rebalance-layers-per-chunk
--eplb-min-rebalancing-utilization-threshold
--expert-distribution-recorder-mode
--expert-distribution-recorder-buffer-size
--expert-balancedness-report-mode
--deepep-config
--moe-dense-tp-size
--elastic-ep-backend
--enable-elastic-expert-backup T
--mooncake-ib-device
--enable-waterfill T
--elastic-ep-join-mode =ep_join_mode
--elastic-ep-join-rank-offset =ep_join_rank_offset
--elastic-ep-initial-size
--max-ep-size
--elastic-ep-scale-timeout
--disable-flashinfer-cutlass-moe-fp4-allgather T
--disable-shared-experts-fusion T
--enforce-shared-experts-fusion T
--max-mamba-cache-size
--mamba-ssm-dtype
--mamba-max-states-per-path
--enable-mamba-cache-stochastic-rounding T
--mamba-cache-philox-rounds
--mamba-full-memory-ratio
--mamba-radix-cache-strategy
--mamba-track-interval
--enable-int8-mamba-checkpoint T
--int8-mamba-ckpt-size
--linear-attn-backend
--linear-attn-decode-backend
--linear-attn-prefill-backend
--linear-attn-verify-backend
--enable-linear-replayssm T
--linear-replayssm-cache-len
--enable-linear-replayssm-spec T
--enable-hierarchical-cache,--enable-hicache T
--hicache-host-memory-mode
--hicache-ratio
--hicache-size
--hicache-write-policy
--hicache-io-backend
--hicache-mem-layout
--hicache-storage-backend
--hicache-storage-prefetch-policy
--hicache-storage-backend-extra-config
--hicache-storage-prefetch-retry-poll-interval
--hicache-storage-prefetch-retry-max-attempts
--enable-unified-cache-external-linker T
--unified-cache-external-linker-backend
--enable-hisparse T
--hisparse-config,--hierarchical-sparse-attention-extra-config
--enable-broadcast-mm-inputs-process T
--enable-prefix-mm-cache T
--mm-enable-dp-encoder B
--mm-process-config
--mm-processor-worker-num
--mm-io-worker-num
--allowed-media-domains +
--media-url-max-file-size-mb
--mm-preprocess-cache-size-mb
--trust-mm-content-hashes T
--limit-mm-data-per-request
--enable-mm-global-cache T
--image-processor-backend
--mm-global-cache-backend
--disable-fast-image-processor T
--mm-feature-transport
--enable-lora T
--enable-lora-overlap-loading T
--max-lora-rank
--lora-target-modules *
--lora-paths x*:LoRAPathAction
--max-loaded-loras
--max-loras-per-batch
--lora-eviction-policy
--lora-backend
--max-lora-chunk-size
--experts-shared-outer-loras B
--lora-use-virtual-experts T
--lora-strict-loading B
--lora-drain-wait-threshold
--enable-two-batch-overlap T
--enable-single-batch-overlap T
--tbo-token-distribution-threshold
--cpu-offload-gb
--offload-group-size
--offload-num-in-group
--offload-prefetch-step
--offload-mode
--enable-lmcache T
--lmcache-config-file
--enable-flexkv T
--flexkv-config-file
--kt-weight-path
--kt-method
--kt-cpuinfer
--kt-threadpool-count
--kt-num-gpu-experts
--kt-max-deferred-experts-per-token
--dllm-algorithm
--dllm-algorithm-config
--dllm-fdfo B
--disaggregation-mode
--disaggregation-transfer-backend
--disaggregation-bootstrap-port
--disaggregation-ib-device
--disaggregation-decode-enable-radix-cache T
--disaggregation-decode-enable-offload-kvcache T
--disaggregation-decode-retraction-backup
--num-reserved-decode-tokens
--disaggregation-decode-extra-slots
--disaggregation-decode-polling-interval
--optimistic-prefill-attempts
--encoder-only T
--language-only T
--language-model-only T
--encoder-transfer-backend
--encoder-urls +
--encoder-bootstrap-port
--encoder-register-urls +
--enable-adaptive-dispatch-to-encoder T
--enable-pdmux T
--pdmux-config-path
--sm-group-num
--startup-weight-load-mode
--custom-weight-loader *
--weight-loader-disable-mmap T
--weight-loader-prefetch-checkpoints T
--weight-loader-prefetch-num-threads
--weight-loader-drop-cache-after-load T
--remote-instance-weight-loader-seed-instance-ip
--remote-instance-weight-loader-seed-instance-service-port
--remote-instance-weight-loader-send-weights-group-ports
--remote-instance-weight-loader-backend
--remote-instance-weight-loader-start-seed-via-transfer-engine T
--engine-info-bootstrap-port
--modelexpress-config
--download-dir
--model-checksum ?
--delete-ckpt-after-loading T
--decrypted-config-file
--decrypted-draft-config-file
--checkpoint-engine-wait-weights-before-ready T
--enable-prefill-delayer T
--prefill-delayer-max-delay-passes
--prefill-delayer-token-usage-low-watermark
--prefill-delayer-forward-passes-buckets +
--prefill-delayer-wait-seconds-buckets +
--prefill-delayer-queue-min-ratio
--prefill-delayer-max-delay-ms
--min-free-slots-delay
--enable-deterministic-inference T
--rl-on-policy-target
--kv-canary
--kv-canary-sweep-interval
--enable-dynamic-batch-tokenizer T
--dynamic-batch-tokenizer-batch-size
--dynamic-batch-tokenizer-batch-timeout
--enable-tokenizer-batch-encode T
--disable-tokenizer-batch-decode T
--debug-tensor-dump-output-folder
--debug-tensor-dump-layers +
--debug-tensor-dump-input-file
--enable-memory-saver T
--enable-weights-cpu-backup T
--enable-draft-weights-cpu-backup T
--enable-custom-logit-processor T
--enable-return-hidden-states T
--return-hidden-states-mode
--enable-return-routed-experts T
--enable-return-indexer-topk T
--sampling-mask-max-tokens
--disable-outlines-disk-cache T
--enable-mis T
--weight-cache-mode
--weight-cache-socket
--weight-cache-timeout
--forward-hooks
--msprobe-dump-config
--ple-offload-embedding B
--ple-offload-backend
--ple-offload-dir
--disaggregation-enable-kv-checksum T
--enable-pd-role-switch T
--speculative-domino-candidate-pool-size
--flashinfer-a2a-dispatch-type
--cuda-graph-max-seq-len-prefill
--prefill-kv-cache-dequant-dtype
--dsv4-attn-backend
--otlp-service-name
--hicache-host-memory-fraction
--enable-linker-mla-dedup T
--swa-prefix-tails
--enable-encoder-swa-bounded-replay T
--enable-decoder-swa-bounded-replay B
--enable-response-store T
--disaggregation-decode-host-receive-threshold
--qsa-indexer-dtype
--disaggregation-decode-allocation-policy
--speculative-use-block-verification T
--speculative-draft-sink-size
--disable-aiter-allreduce-fusion-in-prefill T
--disable-aiter-allreduce-fusion-in-decode T
--enable-amd-monokernel T
--dsa-triton-union
--enable-dsa-fused-indexer B
--enable-watermark T
--watermark-config
--grpc-response-timeout-secs
--enable-paged-experts T
--paged-experts-num-resident
--enable-nvidia-megakernel T
--enable-megamoe-for-layernorm-sp T
--enable-http-worker-reuseport T
--prefill-decode-interval-min-bs
--unified-cache-external-linker-config
--enable-return-aux-hidden-states T
--return-aux-hidden-state-layer-ids +
--sampling-backend
--reasoning-parser
--tool-call-parser
--kv-canary-real-data
--config
--disable-cuda-graph x0:DeprecatedStoreTrueAction
--enable-dp-attention x0:DeprecatedStoreTrueAction
--monokernel-backend x:DeprecatedStoreConstAction =enable_amd_monokernel
--enable-flashinfer-allreduce-fusion T
""",
    ("vllm", "0.30.0"): """\
-h,--help h
@model_tag ?
--headless T
--api-server-count,-asc
--config
--grpc T
--lora-modules x+:LoRAParserAction
--chat-template
--chat-template-content-format
--trust-request-chat-template B
--default-chat-template-kwargs
--response-role
--return-tokens-as-token-ids B
--enable-auto-tool-choice B
--exclude-tools-when-tool-choice-none B
--tool-call-parser
--tool-parser-plugin
--tool-server
--log-config-file
--max-log-len
--enable-prompt-tokens-details B
--enable-per-request-metrics B
--enable-server-load-tracking B
--enable-force-include-usage B
--sse-keep-alive-interval
--enable-tokenizer-info-endpoint B
--enable-log-outputs B
--enable-log-deltas B
--cohere-is-reasoning-model B
--cohere-format
--log-error-stack B
--tokens-only B
--enable-scale-out B
--fingerprint-mode
--fingerprint-value
--host
--port
--data-parallel-supervisor-port
--dp-supervisor-probe-interval-s
--dp-supervisor-probe-timeout-s
--dp-supervisor-probe-failure-threshold
--uds
--uvicorn-log-level
--disable-uvicorn-access-log B
--disable-access-log-for-endpoints
--allow-credentials B
--allowed-origins
--allowed-methods
--allowed-headers
--api-key +
--ssl-keyfile
--ssl-certfile
--ssl-ca-certs
--enable-ssl-refresh B
--ssl-cert-reqs
--ssl-ciphers
--root-path
--middleware A
--enable-request-id-headers B
--disable-fastapi-docs B
--h11-max-incomplete-event-size
--h11-max-header-count
--enable-offline-docs B
--enable-flash-late-interaction B
--model
--runner
--convert
--tokenizer
--tokenizer-mode
--trust-remote-code B
--dtype
--seed
--hf-config-path
--allowed-local-media-path
--allowed-media-domains +
--revision
--code-revision
--tokenizer-revision
--max-model-len
--quantization,-q
--quantization-config
--allow-deprecated-quantization B
--enforce-eager B
--enable-return-routed-experts B
--return-sampling-mask B
--max-logprobs
--logprobs-mode
--use-fp64-gumbel B
--enable-trace-replay B
--disable-sliding-window B
--disable-cascade-attn B
--skip-tokenizer-init B
--enable-prompt-embeds B
--served-model-name +
--config-format
--hf-token ?
--hf-overrides
--model-class-overrides
--pooler-config
--generation-config
--override-generation-config
--enable-sleep-mode B
--enable-cumem-allocator B
--enable-nccl-comm-suspend B
--model-impl
--logits-processors +
--io-processor-plugin
--renderer-num-workers
--load-format
--download-dir
--safetensors-load-strategy
--safetensors-prefetch-num-threads
--safetensors-prefetch-block-size
--model-loader-extra-config
--ignore-patterns +
--use-tqdm-on-load B
--pt-load-map-location
--attention-backend
--mamba-backend
--mamba-ssu-algorithm
--enable-mamba-cache-stochastic-rounding B
--mamba-cache-philox-rounds
--reasoning-parser
--reasoning-parser-plugin
--distributed-executor-backend
--pipeline-parallel-size,-pp
--master-addr
--master-port
--nnodes,-n
--node-rank,-r
--distributed-timeout-seconds
--cpu-distributed-timeout-seconds
--numa-bind B
--numa-bind-nodes +
--numa-bind-cpus +
--device-ids
--tensor-parallel-size,-tp
--decode-context-parallel-size,-dcp
--dcp-comm-backend
--dcp-q-replicate B
--dcp-kv-cache-interleave-size
--cp-kv-cache-interleave-size
--prefill-context-parallel-size,-pcp
--data-parallel-size,-dp
--data-parallel-rank,-dpn
--data-parallel-start-rank,-dpr
--data-parallel-size-local,-dpl
--data-parallel-address,-dpa
--data-parallel-rpc-port,-dpp
--data-parallel-backend,-dpb
--data-parallel-hybrid-lb,-dph B
--data-parallel-external-lb,-dpe B
--data-parallel-multi-port-external-lb,-dpm T
--enable-expert-parallel,-ep B
--enable-batch-sharded-sampling B
--enable-ep-weight-filter B
--all2all-backend
--enable-dbo B
--ubatch-size
--enable-elastic-ep B
--elastic-ep-max-dp-size
--dbo-decode-token-threshold
--dp-sync-interval
--dbo-prefill-token-threshold
--disable-nccl-for-dp-synchronization B
--enable-eplb B
--eplb-config
--expert-placement-strategy
--max-parallel-loading-workers
--ray-workers-use-nsight B
--disable-custom-all-reduce B
--worker-cls
--worker-extension-cls
--enable-fault-tolerance B
--fault-tolerance-config
--block-size
--gpu-memory-utilization
--kv-cache-memory-bytes
--kv-cache-dtype
--num-gpu-blocks-override
--enable-prefix-caching B
--prefix-caching-hash-algo
--prefix-cache-retention-interval
--kv-cache-dtype-skip-layers +
--kv-sharing-fast-prefill B
--mamba-cache-dtype
--mamba-ssm-cache-dtype
--mamba-block-size
--prefix-match-unit
--mamba-cache-mode
--enable-mamba-fine-grained-prefix-cache B
--replayssm-buffer-len
--use-replayssm B
--kv-offloading-size
--kv-offloading-backend
--offload-backend
--cpu-offload-gb
--cpu-offload-params +
--offload-group-size
--offload-num-in-group
--offload-prefetch-step
--offload-params +
--language-model-only B
--limit-mm-per-prompt
--enable-mm-embeds B
--media-io-kwargs
--mm-processor-kwargs
--mm-processor-cache-gb
--mm-processor-cache-type
--mm-hasher-algorithm
--mm-shm-cache-max-object-size-mb
--mm-encoder-only B
--mm-encoder-tp-mode
--mm-encoder-attn-backend
--mm-encoder-attn-dtype
--mm-encoder-fp8-scale-path
--mm-encoder-fp8-scale-save-path
--mm-encoder-fp8-scale-save-margin
--interleave-mm-strings B
--skip-mm-profiling B
--video-pruning-rate
--video-pruning-method
--mm-tensor-ipc
--mm-processor-device
--mm-ipc-gpu-memory-gb
--mm-device-do-normalize B
--enable-lora B
--max-loras
--max-lora-rank
--lora-dtype
--enable-tower-connector-lora B
--max-cpu-loras
--fully-sharded-loras B
--lora-target-modules +
--default-mm-loras
--specialize-active-lora B
--enable-mixed-moe-lora-format B
--enable-moe-shared-loras B
--show-hidden-metrics-for-version
--otlp-traces-endpoint
--collect-detailed-traces +
--per-request-spec-decode-metrics
--kv-cache-metrics B
--kv-cache-metrics-sample
--cudagraph-metrics B
--enable-layerwise-nvtx-tracing B
--enable-mfu-metrics B
--enable-logging-iteration-details B
--jit-monitor-mode
--jit-monitor-verbose B
--max-num-batched-tokens
--max-num-scheduled-tokens
--max-num-seqs
--max-num-queued-reqs
--max-num-queued-tokens
--long-prefill-token-threshold
--scheduling-policy
--enable-chunked-prefill B
--disable-chunked-mm-input B
--scheduler-cls
--scheduler-reserve-full-isl B
--watermark
--prefill-schedule-interval
--disable-hybrid-kv-cache-manager B
--async-scheduling B
--stream-interval
--cudagraph-capture-sizes +
--max-cudagraph-capture-size
--ir-op-priority
--enable-flashinfer-autotune B
--moe-backend
--linear-backend
--sparse-indexer-topk-backend
--speculative-config,-sc
--spec-method
--spec-model
--spec-tokens
--watermark-config
--diffusion-config,-dc
--kv-transfer-config
--kv-events-config
--ec-transfer-config
--ec-manager-config
--compilation-config,-cc
--attention-config,-ac
--engram-config
--reasoning-config
--kernel-config
--additional-config
--structured-outputs-config
--profiler-config
--optimization-level
--performance-mode
--weight-transfer-config
--disable-log-stats T
--aggregate-engine-logging T
--fail-on-environ-validation B
--shutdown-timeout
--gdn-prefill-backend
--kda-prefill-backend
--kda-decode-backend
--enable-log-requests B
""",
}

CHANGES: dict[tuple[str, str], tuple[str, str]] = {
    ("vllm", "0.33.0"): (
        "0.30.0",
        """\
=9
-1
+--trust-request-chat-template E
+--trust-request-mm-kwargs E
=1
+--reasoning-effort-map
=1
-3
+--return-tokens-as-token-ids E
+--enable-auto-tool-choice E
+--exclude-tools-when-tool-choice-none E
=2
+--tool-strict-level
=1
-1
=1
-4
+--enable-prompt-tokens-details E
+--enable-per-request-metrics E
+--enable-server-load-tracking E
+--enable-force-include-usage E
=1
-4
+--enable-tokenizer-info-endpoint E
+--enable-log-outputs E
+--enable-log-deltas E
+--cohere-is-reasoning-model E
=1
-3
+--anthropic-disabled-thinking-effort
+--log-error-stack E
+--tokens-only E
+--enable-scale-out E
=4
+--grpc-port
=6
-1
+--disable-uvicorn-access-log E
=1
-1
+--allow-credentials E
=7
-1
+--enable-ssl-refresh E
=4
-2
+--enable-request-id-headers E
+--disable-fastapi-docs E
=2
-2
+--enable-offline-docs E
+--enable-flash-late-interaction E
=5
-1
+--trust-remote-code E
=11
-4
+--allow-deprecated-quantization E
+--enforce-eager E
+--enable-return-routed-experts E
+--return-sampling-mask E
=2
-6
+--use-fp64-gumbel E
+--enable-trace-replay E
+--disable-sliding-window E
+--disable-cascade-attn E
+--skip-tokenizer-init E
+--enable-prompt-embeds E
=8
-3
+--enable-sleep-mode E
+--sleep-mode-backend
+--sleep-mode-offload-cudagraph E
+--sleep-preserve-parameter-names +
+--enable-cumem-allocator E
+--enable-nccl-comm-suspend E
=11
-1
+--use-tqdm-on-load E
=4
-1
+--enable-mamba-cache-stochastic-rounding E
=11
-1
+--numa-bind E
=6
-1
+--dcp-q-replicate E
=10
-2
+--data-parallel-hybrid-lb,-dph E
+--data-parallel-external-lb,-dpe E
=1
-3
+--enable-hc-sp E
+--enable-expert-parallel,-ep E
+--enable-batch-sharded-sampling E
+--enable-ep-weight-filter E
=1
-1
+--enable-dbo E
+--enable-shm-tensor-arena E
=1
-1
+--enable-elastic-ep E
=4
-2
+--disable-nccl-for-dp-synchronization E
+--enable-eplb E
=3
-2
+--ray-workers-use-nsight E
+--disable-custom-all-reduce E
=2
-1
+--enable-fault-tolerance E
=2
-1
+--gpu-memory-utilization,--device-memory-utilization
=3
-1
+--enable-prefix-caching E
=3
-1
+--kv-sharing-fast-prefill E
+--swa-bounded-replay E
=5
-1
+--enable-mamba-shared-prefix-checkpoint E
=1
-1
+--use-replayssm E
=9
-1
+--language-model-only E
=1
-1
+--enable-mm-embeds E
=6
-1
+--mm-encoder-only E
=6
-2
+--interleave-mm-strings E
+--skip-mm-profiling E
=5
-2
+--mm-device-do-normalize E
+--enable-lora E
=3
-1
+--enable-tower-connector-lora E
=1
-1
+--fully-sharded-loras E
=2
-3
+--specialize-active-lora E
+--enable-mixed-moe-lora-format E
+--enable-moe-shared-loras E
+--max-lora-cls-labels
+--logging-config
+--log-level
+--log-config-file x:DeprecatedLogConfigFileAction
=4
-1
+--kv-cache-metrics E
=1
-4
+--custom-histogram-buckets
+--cudagraph-metrics E
+--enable-layerwise-nvtx-tracing E
+--enable-mfu-metrics E
+--enable-logging-iteration-details E
=1
-1
+--jit-monitor-verbose E
=3
+--max-num-active-seqs
=3
+--long-prefill-token-threshold-adaptive E
=1
-2
+--enable-chunked-prefill E
+--disable-chunked-mm-input E
=1
-1
+--scheduler-reserve-full-isl E
=2
-2
+--disable-hybrid-kv-cache-manager E
+--async-scheduling E
=4
-1
+--enable-flashinfer-autotune E
+--monokernel E
=20
+--aux-output-config
=1
+--watchdog-config
=5
-1
+--fail-on-environ-validation E
=4
-1
+--enable-log-requests E
""",
    ),
    ("vllm", "0.34.0"): (
        "0.33.0",
        """\
=3
+--headless-client-handshake-address
=108
+--checkpoint-prepare-on-startup E
=13
+--shuffle-safetensors-files E
=63
+--enable-extensible-kv-cache E
=82
+--max-num-inflight-kv-loads
=11
+--cache-aware-admission-window
+--cache-aware-admission-threshold
=42
""",
    ),
}
