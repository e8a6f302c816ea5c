"""Names of the checks in ``backend_checks.py``, importable without MPI or torch (pytest parametrises on them)."""
import itertools

WORLD_SIZES = [2, 3, 4]
SIZES = [0, 1, 7, 1000, (1 << 20) + 3]  # elements; 0, 1 and 7 are fewer than the ranks' pairs or ranks
DTYPES = ["float32", "bfloat16"]
COMPRESSORS = ["dragonn", "topk", "randomk"]
# compressor-dtype-n<numel>; the 2^20+ size on the product compressor only (the baselines are slow there)
IDENTITY_CASES = [f"{c}-{d}-n{n}" for c, d, n in itertools.product(COMPRESSORS, DTYPES, SIZES)
                  if c == "dragonn" or n <= 1000]
IDENTITY_CASES.append("dragonn-float32-n4099-dense")  # density 0.5: many indices shared between ranks
# the partitioned exchange: sparse reduce-scatter + server residual + allgather (pairs, or bitmap when dense)
PARTITIONED_CASES = ["dragonn-float32-n0", "dragonn-float32-n1", "dragonn-bfloat16-n7", "topk-float32-n1000",
                     "dragonn-float32-n1048579", "dragonn-bfloat16-n4099-dense"]
ERROR_CHECKS = ["mismatch_partitioned", "mismatch_scheme", "mismatch_numel", "mismatch_dtype", "mismatch_bytes", "mpi_error", "world_mismatch"]
CHECKS = (["mpi_env", "primitives"] + [f"identity/{c}" for c in IDENTITY_CASES]
          + [f"partitioned/{c}" for c in PARTITIONED_CASES] + ERROR_CHECKS
          + ["cuda_aware_flag_on_host"])
