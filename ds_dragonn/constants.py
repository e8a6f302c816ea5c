"""Internal settings of the selection, the policy and the seeds: fixed values, not keys of the ``"dragonn"``
block. Each names what backs it; benchmarks that need another value pass it to the compressor or the policy
directly.
"""

#: Fraction of a bucket sampled for the threshold; the sample is at least MIN_SAMPLE and 256 / density elements
#: (>= 256 expected hits: ~6 % spread of the candidate count; docs/kernels.md; its quality against exact top-k
#: is in docs/results.md#selection-kernels).
SAMPLE_RATIO = 0.001

#: Lower bound on the threshold sample, in elements (capped at the bucket size, where it gives the exact one).
MIN_SAMPLE = 1024

#: Hash-table slots per kept element, ``m = ceil(TABLE_FACTOR * k)``: the DRAGONN paper's 4 (Sec. 4); with the
#: candidate rate 1.151 x density, kept/k is ~1 after collisions (docs/kernels.md).
TABLE_FACTOR = 4.0

#: Timed reductions of each kind (dense, compressed) per bucket before the auto policy decides; the ranks sum
#: their medians (docs/design.md#the-auto-policy). On the 1 Gbit/s link the two differ ~13x (776 ms against 60 ms).
AUTO_PROBE_STEPS = 3

#: Reductions of a bucket between two auto decisions (a link's speed can change over a long run).
AUTO_RECHECK_INTERVAL = 1000

#: Base seed of threshold sampling and hashing; every rank advances it the same way each step, so any fixed
#: value gives the same guarantees (docs/design.md#guarantees).
SEED = 0

#: ``advanced.selection: chunked``: entries per chunk, each chunk sending its own top ``≈ density × CHUNK_SIZE``
#: (SparseLoCo's 4096, Sarfi et al. 2025). A bucket's tail shorter than a chunk joins the last chunk.
CHUNK_SIZE = 4096

#: ``advanced.selection: chunked``: threshold sample per chunk, in elements (1.6 % of a 4096-entry chunk). The
#: threshold sits below the chunk's k-th value (``compress/chunks.py``), so a small sample costs hashed
#: candidates in the scan instead of sampled reads: per chunk ``s`` reads plus ``~2·CHUNK_SIZE/s`` extra
#: candidates is least near ``s = sqrt(2·CHUNK_SIZE) ≈ 90``; 64 is as cheap and reads fewer scattered lines.
CHUNK_SAMPLE = 64

#: ``advanced.selection: chunked``: at most this share of chunks gets a threshold above its k-th largest value
#: (then it sends fewer than its k): the sample's rank is the binomial quantile of this tail.
CHUNK_MISS = 0.01
