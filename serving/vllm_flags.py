"""vLLM's whole `vllm serve` flag surface, so no vLLM command line is silently misread.

`jaxllm serve` implements many of vLLM's flags (jaxllm/config.py, serving/cli_args.py). Every
other flag of vLLM 0.32 is still recognised here, and:
- refused at start-up with an error naming it (a deployment relying on it learns at once), or
- for flags that are no-ops in vLLM itself (or were, before vLLM dropped them), accepted with
  vLLM's deprecation warning, or
- for flags asking for what jaxllm already does, accepted with a note saying so.
The lists are vLLM 0.32's parser (engine and front-end arguments, short aliases included), taken
from its source by scripts/list_vllm_flags.py; regenerate them when following a newer vLLM.
"""

from __future__ import annotations

import argparse
import logging

from jaxllm.config import ConfigError

logger = logging.getLogger("jaxllm.serving")
VLLM_VERSION = "0.32.0"

ENGINE_FLAGS = """
    --runner --convert --tokenizer --tokenizer-mode --trust-remote-code --dtype --seed
    --hf-config-path --allowed-local-media-path --allowed-media-domains --revision
    --code-revision --tokenizer-revision --max-model-len --quantization -q --quantization-config
    --allow-deprecated-quantization --enforce-eager --enable-return-routed-experts
    --return-sampling-mask --max-logprobs --logprobs-mode --use-fp64-gumbel
    --enable-trace-replay --disable-sliding-window --disable-cascade-attn --skip-tokenizer-init
    --enable-prompt-embeds --served-model-name --config-format --hf-token --hf-overrides
    --model-class-overrides --pooler-config --generation-config --override-generation-config
    --enable-sleep-mode --sleep-mode-offload-cudagraph --sleep-preserve-parameter-names
    --enable-cumem-allocator --enable-nccl-comm-suspend --model-impl --logits-processors
    --io-processor-plugin --renderer-num-workers --load-format --download-dir
    --safetensors-load-strategy --safetensors-prefetch-num-threads
    --safetensors-prefetch-block-size --model-loader-extra-config --ignore-patterns
    --use-tqdm-on-load --pt-load-map-location --attention-backend --mamba-backend
    --mamba-ssu-algorithm --enable-mamba-cache-stochastic-rounding --mamba-cache-philox-rounds
    --reasoning-parser --reasoning-parser-plugin --distributed-executor-backend
    --pipeline-parallel-size -pp --master-addr --master-port --nnodes -n --node-rank -r
    --distributed-timeout-seconds --cpu-distributed-timeout-seconds --numa-bind
    --numa-bind-nodes --numa-bind-cpus --device-ids --tensor-parallel-size -tp
    --decode-context-parallel-size -dcp --dcp-comm-backend --dcp-q-replicate
    --dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size --prefill-context-parallel-size
    -pcp --data-parallel-size -dp --data-parallel-rank -dpn --data-parallel-start-rank -dpr
    --data-parallel-size-local -dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp
    --data-parallel-backend -dpb --data-parallel-hybrid-lb -dph --data-parallel-external-lb -dpe
    --data-parallel-multi-port-external-lb -dpm --enable-hc-sp --enable-expert-parallel -ep
    --enable-batch-sharded-sampling --enable-ep-weight-filter --all2all-backend --enable-dbo
    --enable-shm-tensor-arena --ubatch-size --enable-elastic-ep --elastic-ep-max-dp-size
    --dbo-decode-token-threshold --dp-sync-interval --dbo-prefill-token-threshold
    --disable-nccl-for-dp-synchronization --enable-eplb --eplb-config
    --expert-placement-strategy --max-parallel-loading-workers --ray-workers-use-nsight
    --disable-custom-all-reduce --worker-cls --worker-extension-cls --enable-fault-tolerance
    --fault-tolerance-config --block-size --gpu-memory-utilization --device-memory-utilization
    --kv-cache-memory-bytes --kv-cache-dtype --num-gpu-blocks-override --enable-prefix-caching
    --prefix-caching-hash-algo --prefix-cache-retention-interval --kv-cache-dtype-skip-layers
    --kv-sharing-fast-prefill --swa-bounded-replay --mamba-cache-dtype --mamba-ssm-cache-dtype
    --mamba-block-size --prefix-match-unit --mamba-cache-mode
    --enable-mamba-shared-prefix-checkpoint --replayssm-buffer-len --use-replayssm
    --kv-offloading-size --kv-offloading-backend --offload-backend --cpu-offload-gb
    --cpu-offload-params --offload-group-size --offload-num-in-group --offload-prefetch-step
    --offload-params --language-model-only --limit-mm-per-prompt --enable-mm-embeds
    --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb --mm-processor-cache-type
    --mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --mm-encoder-only
    --mm-encoder-tp-mode --mm-encoder-attn-backend --mm-encoder-attn-dtype
    --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path
    --mm-encoder-fp8-scale-save-margin --interleave-mm-strings --skip-mm-profiling
    --video-pruning-rate --video-pruning-method --mm-tensor-ipc --mm-processor-device
    --mm-ipc-gpu-memory-gb --mm-device-do-normalize --enable-lora --max-loras --max-lora-rank
    --lora-dtype --enable-tower-connector-lora --max-cpu-loras --fully-sharded-loras
    --lora-target-modules --default-mm-loras --specialize-active-lora
    --enable-mixed-moe-lora-format --enable-moe-shared-loras --max-lora-cls-labels
    --logging-config --log-level --log-config-file --show-hidden-metrics-for-version
    --otlp-traces-endpoint --collect-detailed-traces --per-request-spec-decode-metrics
    --kv-cache-metrics --kv-cache-metrics-sample --custom-histogram-buckets --cudagraph-metrics
    --enable-layerwise-nvtx-tracing --enable-mfu-metrics --enable-logging-iteration-details
    --jit-monitor-mode --jit-monitor-verbose --max-num-batched-tokens --max-num-scheduled-tokens
    --max-num-seqs --max-num-active-seqs --max-num-queued-reqs --max-num-queued-tokens
    --long-prefill-token-threshold --long-prefill-token-threshold-adaptive --scheduling-policy
    --enable-chunked-prefill --disable-chunked-mm-input --scheduler-cls
    --scheduler-reserve-full-isl --watermark --prefill-schedule-interval
    --disable-hybrid-kv-cache-manager --async-scheduling --stream-interval
    --cudagraph-capture-sizes --max-cudagraph-capture-size --ir-op-priority
    --enable-flashinfer-autotune --moe-backend --linear-backend --sparse-indexer-topk-backend
    --speculative-config -sc --spec-method --spec-model --spec-tokens --watermark-config
    --diffusion-config -dc --kv-transfer-config --kv-events-config --ec-transfer-config
    --ec-manager-config --compilation-config -cc --attention-config -ac --engram-config
    --reasoning-config --kernel-config --additional-config --structured-outputs-config
    --aux-output-config --profiler-config --optimization-level --performance-mode
    --weight-transfer-config --disable-log-stats --aggregate-engine-logging
    --fail-on-environ-validation --shutdown-timeout --gdn-prefill-backend --kda-prefill-backend
    --kda-decode-backend --enable-log-requests --model
""".split()

FRONTEND_FLAGS = """
    --headless --api-server-count -asc --config --grpc --lora-modules --chat-template
    --chat-template-content-format --trust-request-chat-template --trust-request-mm-kwargs
    --default-chat-template-kwargs --response-role --return-tokens-as-token-ids
    --enable-auto-tool-choice --exclude-tools-when-tool-choice-none --tool-call-parser
    --tool-parser-plugin --tool-strict-level --tool-server --max-log-len
    --enable-prompt-tokens-details --enable-per-request-metrics --enable-server-load-tracking
    --enable-force-include-usage --sse-keep-alive-interval --enable-tokenizer-info-endpoint
    --enable-log-outputs --enable-log-deltas --cohere-is-reasoning-model --cohere-format
    --anthropic-disabled-thinking-effort --log-error-stack --tokens-only --enable-scale-out
    --fingerprint-mode --fingerprint-value --host --port --grpc-port
    --data-parallel-supervisor-port --dp-supervisor-probe-interval-s
    --dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold --uds
    --uvicorn-log-level --disable-uvicorn-access-log --disable-access-log-for-endpoints
    --allow-credentials --allowed-origins --allowed-methods --allowed-headers --api-key
    --ssl-keyfile --ssl-certfile --ssl-ca-certs --enable-ssl-refresh --ssl-cert-reqs
    --ssl-ciphers --root-path --middleware --enable-request-id-headers --disable-fastapi-docs
    --h11-max-incomplete-event-size --h11-max-header-count --enable-offline-docs
    --enable-flash-late-interaction
""".split()

# Flag -> (takes a value, vLLM's warning). No-ops in vLLM itself: accepted, with its warning.
DEPRECATED_NOOPS = {
    "--disable-cascade-attn": (False, "--disable-cascade-attn is deprecated and has no effect "
                               "since cascade attention has been removed."),
    "--use-v2-block-manager": (False, "--use-v2-block-manager is deprecated and has no effect "
                               "(the v2 block manager is the only one); vLLM removed it."),
    "--swap-space": (True, "--swap-space is deprecated and has no effect: preempted requests "
                     "are recomputed, never swapped to CPU memory (as in vLLM V1)."),
}
# Flag -> why it needs no implementation here: what it asks for is what jaxllm always does.
ALREADY_SO = {
    "--disable-custom-all-reduce": "jaxllm has no custom all-reduce; XLA runs every collective",
}
OTHER_FLAGS = ENGINE_FLAGS + FRONTEND_FLAGS + list(DEPRECATED_NOOPS)


class _Given(argparse.Action):
    """Record that a vLLM flag jaxllm lacks was given (checked by `check_vllm_flags`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.vllm_flags_given = [*getattr(namespace, "vllm_flags_given", []),
                                      option_string]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Recognise every vLLM flag the parser does not define yet (hidden from --help)."""
    known = set(parser._option_string_actions)
    for flag in dict.fromkeys(OTHER_FLAGS):
        if flag in known:
            continue
        takes_value = DEPRECATED_NOOPS.get(flag, (flag not in ALREADY_SO,))[0]
        names = [flag] + ([f"--no-{flag[2:]}"] if flag.startswith("--") and not takes_value
                          else [])
        parser.add_argument(*[n for n in names if n not in known], action=_Given,
                            dest="vllm_flags_given", default=argparse.SUPPRESS,
                            nargs="?" if takes_value else 0, help=argparse.SUPPRESS)


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Warn for vLLM's no-op flags; refuse, naming it, any vLLM flag jaxllm does not implement."""
    for flag in getattr(args, "vllm_flags_given", []):
        base = flag.replace("--no-", "--", 1)
        if base in DEPRECATED_NOOPS:
            logger.warning(DEPRECATED_NOOPS[base][1])
        elif base in ALREADY_SO:
            logger.info("%s: %s.", flag, ALREADY_SO[base])
        else:
            raise ConfigError(f"{flag} is a vLLM {VLLM_VERSION} flag that jaxllm does not "
                              f"implement; remove it (it is refused rather than ignored).")
