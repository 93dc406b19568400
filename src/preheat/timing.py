"""Engine timing profiles: how long one engine step takes on given hardware and model.

Pure: no I/O, no clock. The simulated engine sleeps ``step_time`` (scaled), the fleet
simulator advances virtual time by it; both call the functions here.

Model of one continuous-batching step (a roofline, as in vLLM's own performance
analyses: decode is bound by reading the weights and the KV cache from HBM, prefill by
matrix-multiply FLOPs)::

    step = step_overhead_s
         + max(weight_read_s, (prefill_tokens + decode_seqs) * token_compute_s)
         + prefill_attn_pairs * attn_pair_s          # causal attention of new tokens
         + decode_context_tokens * kv_read_s          # decode attention reads each seq's KV

* ``weight_read_s`` = weight bytes / (aggregate HBM bandwidth x 0.70 achieved).
* ``token_compute_s`` = 2 x parameters FLOPs / (aggregate dense BF16 FLOP/s x 0.40 MFU).
* ``attn_pair_s`` = 4 x layers x hidden FLOPs per (query, key) pair / same FLOP/s.
* ``kv_read_s`` = KV bytes per token / (aggregate HBM bandwidth x 0.70).
* ``step_overhead_s``: scheduler, sampling, kernel launches and (TP>1) all-reduces.

Hardware sources: NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense
BF16), NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, same compute as H100).
Model sources: the models' Hugging Face ``config.json`` (layers, hidden size, KV heads,
head dim) and model cards (parameter counts).
Efficiencies and KV capacity: vLLM reserves ``gpu_memory_utilization`` = 0.90 of GPU
memory; KV capacity is what is left after weights and a per-GPU activation/CUDA-graph
reserve, divided by KV bytes per token (what vLLM logs as "GPU KV cache size").
Calibration anchors (published vLLM measurements the derived numbers are checked against):

* J. Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" (johnmusgrave.com, vLLM
  0.23, Llama-3.1-8B BF16, 1024-in/128-out): single-stream decode ~75 tok/s on one
  A100-40GB, "roughly 77 % of the GPU's memory-bandwidth ceiling", flat up to ~8
  concurrent streams. Hence ``_BW_EFF`` = 0.70 and memory-bound decode; the same model
  on one H100 predicts ~7.9 ms TPOT (8B profile below).
* Lambda Labs, "vllm-benchmark" (github.com/LambdaLabsML/vllm-benchmark, benchmark_v0.md,
  vLLM 0.5.4, 320 concurrent prompts, 2k context): Llama-3.1-8B-FP8 on 1xH100 3,400 output
  tok/s at 19.75 ms per token. Our 8B roofline with FP8 halving weight bytes and FLOPs,
  the batch capped by KV capacity (~230 x 2k tokens) and ~1k mean context gives 18.5 ms.
  Same report: Llama-3.1-70B-FP8 on 8xH100 2,573 tok/s at 33.7 ms; vLLM 0.5.4 still had
  the CPU overhead that v0.6 removed (next item), so our 70B profile is faster there
  (~13 ms with FP8 weights, ~19 ms in BF16, at 256 x 1k context).
* vLLM blog "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction"
  (blog.vllm.ai/2024/09/05/perf-update.html): CPU scheduling overhead dominated small
  steps before v0.6 (Llama-3-8B on 1xH100, 70B on 4xH100); hence a fixed per-step overhead
  of 1 ms (one GPU) to 3 ms (TP=8 all-reduces) and no per-token CPU cost.
* Prefill at 40 % MFU (``_MFU``) is an assumption: H100 dense-GEMM kernels reach 60-70 %
  of peak, and vLLM's prefill adds attention, norms and scheduling. A check against the
  only end-to-end figure at hand: AWS's "Reduce LLM latency with prefix-aware routing on
  Amazon SageMaker Inference" (Llama-3.1-70B, p5.48xlarge = 8xH100, vLLM, 8,000-token
  shared prefix) reports P50 TTFT -71 to -77 % once the prefix hits; our 70B profile
  predicts -78 % for an 8,000-token hit with ~2,000 uncached tokens on an idle engine
  (-88 % with 1,000), i.e. the same order (their TTFT also includes queueing).
* vLLM's defaults: ``gpu_memory_utilization`` 0.90, ``block_size`` 16,
  ``max_num_batched_tokens`` 8192 for the OpenAI server on large GPUs, ``max_num_seqs``
  256 (vLLM engine-argument documentation).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PROFILES",
    "EngineProfile",
    "StepWork",
    "get_profile",
    "prefill_attn_pairs",
]

# Hardware constants (datasheets; see module docstring).
_H100_HBM_BPS = 3.35e12
_H100_BF16_FLOPS = 989e12
_H100_MEM = 80e9
_H200_HBM_BPS = 4.8e12
_H200_MEM = 141e9
_BW_EFF = 0.70  # achieved fraction of HBM bandwidth in decode GEMV/attention kernels
_MFU = 0.40  # achieved fraction of dense BF16 FLOP/s in prefill
_GPU_MEM_UTIL = 0.90  # vLLM's default gpu_memory_utilization


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes."""

    prefill_tokens: int = 0
    """New prompt tokens computed this step (all chunks together)."""
    prefill_attn_pairs: int = 0
    """Sum over those tokens of how many positions each attends to (see prefill_attn_pairs)."""
    decode_seqs: int = 0
    """Sequences producing one output token this step."""
    decode_context_tokens: int = 0
    """Sum of the context lengths of the decoding sequences."""

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def prefill_attn_pairs(start: int, n: int) -> int:
    """(query, key) pairs when ``n`` new tokens follow ``start`` computed ones, causally."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class EngineProfile:
    """Timing and capacity of one engine (hardware x model x parallelism)."""

    name: str
    model: str
    """The served model name (what /v1/models lists)."""
    hardware: str
    engine: str
    tensor_parallel: int
    weights_bytes: int
    max_model_len: int
    """Longest prompt + output the engine accepts, in tokens."""
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    step_overhead_s: float
    weight_read_s: float
    token_compute_s: float
    attn_pair_s: float
    kv_read_s: float
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    """Token budget per step (vLLM ``max_num_batched_tokens``; chunked prefill)."""
    max_num_seqs: int = 256
    """Most sequences running at once (vLLM ``max_num_seqs``)."""
    source: str = ""

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    @property
    def prefill_tokens_per_s(self) -> float:
        """Headline prefill throughput: linear layers only (long chunk, short context)."""
        return 1.0 / self.token_compute_s

    def step_time(self, work: StepWork) -> float:
        """Seconds one step takes; 0 for an empty step."""
        if work.empty:
            return 0.0
        linear = max(
            self.weight_read_s, (work.prefill_tokens + work.decode_seqs) * self.token_compute_s
        )
        return (
            self.step_overhead_s
            + linear
            + work.prefill_attn_pairs * self.attn_pair_s
            + work.decode_context_tokens * self.kv_read_s
        )

    def decode_step_time(self, batch: int, context_tokens_per_seq: int) -> float:
        """Inter-token latency of a pure decode step of ``batch`` sequences."""
        return self.step_time(
            StepWork(decode_seqs=batch, decode_context_tokens=batch * context_tokens_per_seq)
        )

    def prefill_time(
        self, prompt_tokens: int, cached_tokens: int = 0, chunk: int | None = None
    ) -> float:
        """Time to first token of one request alone on an idle engine.

        The uncached part is computed in chunks of ``chunk`` tokens (default the step
        budget); the step computing the last prompt token also samples the first output.
        """
        chunk = chunk or self.max_num_batched_tokens
        done = min(cached_tokens, prompt_tokens - 1)
        total = 0.0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            total += self.step_time(
                StepWork(prefill_tokens=n, prefill_attn_pairs=prefill_attn_pairs(done, n))
            )
            done += n
        return total


def _derive(
    *,
    name: str,
    model: str,
    hardware: str,
    gpus: int,
    hbm_bps: float,
    flops: float,
    gpu_mem: float,
    params: float,
    layers: int,
    hidden: int,
    kv_heads: int,
    head_dim: int,
    max_model_len: int,
    step_overhead_s: float,
    reserve_per_gpu: float,
    source: str,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> EngineProfile:
    weights = int(params * 2)  # BF16
    kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, BF16
    bw = gpus * hbm_bps * _BW_EFF
    fl = gpus * flops * _MFU
    kv_bytes = gpus * gpu_mem * _GPU_MEM_UTIL - weights - gpus * reserve_per_gpu
    return EngineProfile(
        name=name,
        model=model,
        hardware=hardware,
        engine="vllm",
        tensor_parallel=gpus,
        weights_bytes=weights,
        max_model_len=max_model_len,
        kv_bytes_per_token=kv_per_token,
        kv_capacity_tokens=int(kv_bytes // kv_per_token) // 16 * 16,
        step_overhead_s=step_overhead_s,
        weight_read_s=weights / bw,
        token_compute_s=2 * params / fl,
        attn_pair_s=4 * layers * hidden / fl,
        kv_read_s=kv_per_token / bw,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        source=source,
    )


# Llama-3.1-70B-Instruct: 70.6 B parameters, 80 layers, hidden 8192, 8 KV heads x 128
# (config.json). TP=8 adds two all-reduces per layer per step: ~3 ms overhead per step.
# Derived: weights 141 GB, 320 KiB KV/token, ~1.23 M KV tokens, TPOT ~10.5 ms at batch 1
# and ~12.8 ms at batch 64 x 2k context, prefill ~22k tok/s (8k-token TTFT ~0.39 s).
LLAMA_70B_8XH100 = _derive(
    name="llama-3.1-70b-8xh100",
    model="meta-llama/Llama-3.1-70B-Instruct",
    hardware="8x NVIDIA H100 SXM 80GB",
    gpus=8,
    hbm_bps=_H100_HBM_BPS,
    flops=_H100_BF16_FLOPS,
    gpu_mem=_H100_MEM,
    params=70.6e9,
    layers=80,
    hidden=8192,
    kv_heads=8,
    head_dim=128,
    max_model_len=131072,
    step_overhead_s=0.003,
    reserve_per_gpu=4e9,
    source="roofline from H100 datasheet + Llama-3.1-70B config; anchors in module docstring",
)

# Llama-3.1-8B-Instruct: 8.03 B parameters, 32 layers, hidden 4096, 8 KV heads x 128.
# Derived: weights 16 GB, 128 KiB KV/token, ~404k KV tokens, TPOT ~7.9 ms at batch 1
# (Ori/Azure: 7-8 ms single stream), prefill ~25k tok/s.
LLAMA_8B_1XH100 = _derive(
    name="llama-3.1-8b-1xh100",
    model="meta-llama/Llama-3.1-8B-Instruct",
    hardware="1x NVIDIA H100 SXM 80GB",
    gpus=1,
    hbm_bps=_H100_HBM_BPS,
    flops=_H100_BF16_FLOPS,
    gpu_mem=_H100_MEM,
    params=8.03e9,
    layers=32,
    hidden=4096,
    kv_heads=8,
    head_dim=128,
    max_model_len=131072,
    step_overhead_s=0.001,
    reserve_per_gpu=3e9,
    source="roofline from H100 datasheet + Llama-3.1-8B config; anchors in module docstring",
)

# Qwen3-32B: 32.8 B parameters, 64 layers, hidden 5120, 8 KV heads x 128 (config.json);
# native context 32,768 tokens. Derived: weights 66 GB, 256 KiB KV/token, ~215k KV
# tokens on one H200, TPOT ~20.6 ms at batch 1, prefill ~6k tok/s.
QWEN3_32B_1XH200 = _derive(
    name="qwen3-32b-1xh200",
    model="Qwen/Qwen3-32B",
    hardware="1x NVIDIA H200 141GB",
    gpus=1,
    hbm_bps=_H200_HBM_BPS,
    flops=_H100_BF16_FLOPS,
    gpu_mem=_H200_MEM,
    params=32.8e9,
    layers=64,
    hidden=5120,
    kv_heads=8,
    head_dim=128,
    max_model_len=32768,
    step_overhead_s=0.001,
    reserve_per_gpu=4e9,
    source="roofline from H200 datasheet + Qwen3-32B config; anchors in module docstring",
)

# A small, fast profile for tests and demos: a 16 MiB "model", 32k context, 64k KV tokens.
# Shaped like the real ones (memory-bound decode, compute-bound prefill) so ratios such as
# cached vs cold TTFT behave the same way, only ~100x cheaper.
TINY = EngineProfile(
    name="tiny",
    model="preheat/tiny",
    hardware="simulated",
    engine="vllm",
    tensor_parallel=1,
    weights_bytes=16 * 1024 * 1024,
    max_model_len=32768,
    kv_bytes_per_token=1024,
    kv_capacity_tokens=65536,
    step_overhead_s=0.0005,
    weight_read_s=0.0015,
    token_compute_s=2e-6,
    attn_pair_s=2e-11,
    kv_read_s=1e-9,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    source="synthetic, for tests",
)

PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (LLAMA_70B_8XH100, LLAMA_8B_1XH100, QWEN3_32B_1XH200, TINY)
}


def get_profile(name: str) -> EngineProfile:
    """Look up a profile by name; ``KeyError`` naming the choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown engine profile {name!r}; choose one of {', '.join(sorted(PROFILES))}"
        ) from None
