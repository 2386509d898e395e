"""The kernel tuner: one tool beside the tables it writes (kernels/configs/ and the node's
cache directory).

- sweep.py: the decode GEMM's tilings per group, batch bucket and adapter count (and a
  mixture of experts' grouped GEMMs per batch bucket: moe_experts.py's cases), every
  candidate through the node's dispatch, checked against the reference and timed, within a
  budget that logs its progress.
- tune.py: a table made on this device, with its key's metadata (dtype, torch and Triton
  versions) and its tuning time (TuningTable.tuning_s: what the benchmarks print per shape).
- store.py: where a node's table comes from (seed, cache, tuned now), the lock and the refusal
  of tables that are not the key's. Torch-free.
- cli.py: `inference-node tune`.
- For maintainers: profile.py (`python -m inference_node.tuner.profile`: a decode step's
  graph replay and kernels per adapter configuration and launch choice) and lora_sweep.py
  (the LoRA shrink/expand launches' tilings, not yet Tuning choices), fp8_gemm.py (`python -m
  inference_node.tuner.fp8_gemm`: the FP8 decode GEMM against bf16 per projection, with an
  optional sweep of its tilings), moe_experts.py (`python -m inference_node.tuner.moe_experts`:
  the routed experts' grouped GEMMs per moe_tilings against the bytes of the experts hit,
  both GEMMs together; it also builds the node sweep's experts.gate_up / experts.down cases).

Nothing here is imported by the launcher or the front ends: the engine core resolves the
table (node.resolve_tuning_table) before any weight loads.
"""
