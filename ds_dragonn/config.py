"""The ``"dragonn"`` block of a DeepSpeed config, validated with pydantic.

The block sits at the top level of ``ds_config.json`` next to DeepSpeed's own sections (DeepSpeed keeps
unknown top-level keys in ``engine.config``)::

    "dragonn": {"enabled": true, "density": 0.01}

Validation follows DeepSpeed's ``runtime/config_utils.DeepSpeedConfigModel``: unknown keys are rejected,
every field is typed and bounded, choices are enums, and cross-field checks raise ``ValueError``.
Errors surface as :class:`DragonnConfigError`, whose message names the bad key, the value given and what
is allowed.
"""
from __future__ import annotations

import difflib
import os
from enum import Enum
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import Field, StrictInt, ValidationError, ValidationInfo, field_validator, model_validator
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

DRAGONN_KEY = "dragonn"
#: the momentum mode's own settings (refused or ignored where that mode does not run)
MOMENTUM_KEYS = ("variance_refresh_steps", "variance_refresh_decay", "lr_weighted_residual")


class DragonnConfigError(ValueError):
    """Raised when the ``"dragonn"`` block is invalid; the message names the key, value and what is allowed."""


class CommBackendName(str, Enum):
    torch = "torch"  # deepspeed.comm: NCCL on GPU, gloo on CPU
    mpi = "mpi"  # mpi4py


class ExchangeScheme(str, Enum):
    allgather = "allgather"  # every rank gathers every rank's (index, value) pairs (DRAGONN paper, Sec. 4)
    partitioned = "partitioned"  # sparse reduce-scatter to balanced owners + server residual + allgather


class SelectionScope(str, Enum):
    per_tensor = "per_tensor"  # each parameter of a bucket gets its own k and threshold (DRAGONN paper, Sec. 4)
    global_ = "global"  # one threshold over the whole flattened bucket


class Policy(str, Enum):
    auto = "auto"  # compress a bucket only where it measured faster than the dense allreduce
    always = "always"  # compress every bucket above min_compress_numel after the warm-up


class CompressorName(str, Enum):
    dragonn = "dragonn"  # sampled threshold + hashed index table (DRAGONN paper)
    topk = "topk"  # exact top-k of |g| (baseline)
    randomk = "randomk"  # uniform random k elements (baseline)


class CompressTarget(str, Enum):
    auto = "auto"  # momentum for an Adam-type optimizer with decoupled weight decay, else gradient
    gradient = "gradient"  # the gradient, with error feedback (DRAGONN paper)
    momentum = "momentum"  # each rank's local momentum, with error feedback; Adam's variance frozen (1-bit Adam)


class SyncMode(str, Enum):
    every_step = "every_step"  # every optimizer step's gradient is exchanged (compressed or dense)
    local_steps = "local_steps"  # ranks step alone; every local_steps steps the pseudo-gradient is exchanged (DiLoCo)


class Kernel(str, Enum):
    auto = "auto"  # triton on CUDA, the C++ library on CPU, else reference
    reference = "reference"  # pure PyTorch (any device; the definition the others are tested against)
    cpu = "cpu"  # C++ one-pass library (CPU tensors; needs a C++ compiler at first use)
    triton = "triton"  # Triton kernels (CUDA tensors; needs the triton package)


#: What an integer and "auto" mean for the keys that take either (their validation message).
_STEPS_OR_AUTO = {
    "warmup_steps": "(dense steps before compression starts), or \"auto\" (twice the learning-rate warm-up, at "
                    "least 30)",
    "density_warmup_steps": "(steps over which the density falls to 'density' after the dense warm-up), or \"auto\" "
                            "(three times the dense warm-up, at least 100)",
}


class DragonnConfig(DeepSpeedConfigModel):
    """Settings of DRAGONN gradient compression (all optional; defaults follow the DRAGONN paper)."""

    # strict scalars: "true" or 1 is not a bool, true is not a density, "0.5" is not a number
    model_config = {"extra": "forbid", "validate_assignment": True, "use_enum_values": False,
                    "populate_by_name": True, "allow_inf_nan": False}

    enabled: bool = Field(False, strict=True)
    """Switch compression on. When false (or the block is absent) the engine is not touched."""

    density: float = Field(0.01, gt=0.0, le=1.0, strict=True)
    """Fraction of a buffer's elements kept per step, ``k = ceil(density * numel)``. 1.0 keeps everything."""

    sample_ratio: float = Field(0.001, gt=0.0, le=1.0, strict=True)
    """Fraction of the buffer sampled to estimate the top-k threshold
    (``s = max(min_sample, ceil(r*numel), ceil(256/density))``, capped at numel)."""

    min_sample: int = Field(1024, ge=1, strict=True)
    """Lower bound on the threshold sample size, in elements (capped at the buffer size)."""

    table_factor: float = Field(4.0, ge=1.0, le=1024.0, strict=True)
    """Hash-table capacity as a multiple of k: ``m = ceil(table_factor * k)`` slots (paper: 4)."""

    min_compress_numel: int = Field(1 << 16, ge=0, strict=True)
    """Buffers with fewer elements go through DeepSpeed's dense allreduce (paper: 2^20 per tensor)."""

    warmup_steps: Union[Literal["auto"], StrictInt] = "auto"
    """Optimizer steps that use the dense allreduce before compression starts (paper: 200). Adam's variance
    is estimated from them (``freeze_adam_variance``, the momentum mode). ``"auto"`` (default): twice the
    engine's learning-rate warm-up, at least 30 (engine/warmup.py reads DeepSpeed's ``Warmup*`` schedules and
    torch ``LambdaLR``, e.g. Hugging Face's; where the engine holds none it can read, the hook follows the
    optimizer's learning rate: a constant one gives 30). The dense warm-up should end after the
    learning-rate warm-up: on the 1.85 M GPT at a better-tuned learning rate (2e-3, a 50-step learning-rate
    warm-up) 100 steps instead of 30 cut the final gap to dense from +9.1 % to +3.7 % (docs/results.md)."""

    density_warmup_steps: Union[Literal["auto"], StrictInt] = "auto"
    """Steps after ``warmup_steps`` over which the density falls exponentially from
    ``density_warmup_start`` to ``density`` (DGC's warm-up, Lin et al., ICLR 2018, Sec. 3.3); 0: none.
    ``"auto"`` (default): three times the dense warm-up, at least 100 (300 after the LM/GPT's 100 dense
    steps; schedule.py). An element waits ~1/density steps for its turn, which costs most while the loss
    falls fastest: on the 1.85 M GPT at lr 2e-3, 300 steps instead of 100 cut the final gap to dense from
    +2.75 % to +1.6 % (3 seeds, docs/results.md) for 0.099 instead of 0.086 of dense bytes over 2000 steps."""

    density_warmup_start: float = Field(0.25, gt=0.0, le=1.0, strict=True)
    """Density of the first compressed step of the density warm-up (DGC: 0.25). A start at or below
    ``density`` means no density warm-up."""

    freeze_adam_variance: bool = Field(False, strict=True)
    """Freeze an Adam-type optimizer's second moment (``exp_avg_sq``) at the end of the dense warm-up
    (``warmup_steps``, which must be at least 1: the variance is estimated from dense steps), as 1-bit Adam
    does: error feedback delivers what waited in a burst, which Adam's variance would otherwise divide away
    (``engine/adam.py``). Only with error feedback and ``density`` below 1; no effect on optimizers without
    ``exp_avg_sq``. Off by default: where an element's variance was ~0 in the warm-up and its gradient grows
    later, the frozen preconditioner makes huge steps (measured: one of three classifier seeds diverged)."""

    compress: CompressTarget = CompressTarget.auto
    """What is sparsified and exchanged. ``auto`` (default): ``momentum`` for an Adam-type optimizer with
    decoupled or no weight decay (AdamW, Adam, FusedAdam) when there is a dense warm-up, error feedback and
    a density below 1, else ``gradient`` (logged at start-up). ``gradient``: the gradient, with error feedback;
    the optimizer runs unchanged. ``momentum`` (Adam-type optimizers only): 1-bit Adam's structure (Tang et al., ICML 2021) with
    DRAGONN selection in place of 1-bit quantisation: after the dense warm-up (``warmup_steps`` >= 1) each
    rank keeps a local momentum ``β1·M + (1 − β1)·g`` of its own gradient (``β1``: the optimizer's), error
    feedback acts on that momentum, the ranks exchange the sparse momentum, and Adam applies the average
    with its variance frozen from the warm-up (floored: ``variance_floor``). Delays then stay linear: a
    burst is not divided away by a variance it inflated. Costs one more fp32 buffer per gradient element
    (two with fp16, or bf16 with ``check_grad_overflow``)."""

    variance_floor: float = Field(0.01, ge=0.0, le=1.0, strict=True)
    """Where Adam's variance is frozen (``compress: momentum``, ``freeze_adam_variance``): each parameter
    tensor's frozen ``sqrt(v)`` is at least this fraction of the tensor's mean ``sqrt(v)``, so that an element
    whose gradient was ~0 during the warm-up cannot take huge steps later. 0: no floor."""

    variance_refresh_steps: int = Field(100, ge=0, strict=True)
    """``compress: momentum``: every this many steps after the dense warm-up, one step reduces the raw
    gradient densely (DeepSpeed's own collective) instead of the momentum, and Adam's frozen variance moves
    towards its square: ``V̂ ← ρ·V̂ + (1 − ρ)·ḡ²`` (``variance_refresh_decay``). That step applies no Adam
    update (its momentum stays in the residual, sent later: nothing is lost). 0/1 Adam's variance updates
    (Lu et al., ICLR 2022): a variance frozen after the warm-up drifts up to ~10x per tensor from Adam's
    over a run (docs/results/convergence/momentum/variance_drift.json). 0: never (1-bit Adam's freeze);
    1 is refused (nothing would be sent). Costs one dense reduction per ``variance_refresh_steps`` steps."""

    lr_weighted_residual: bool = Field(False, strict=True)
    """``compress: momentum``: the residual holds each step's momentum weighted by that step's learning rate,
    ``(lr_t / lr_ref)·M_t``, and what arrives is handed to the optimizer divided by ``lr_t / lr_ref``, so that
    a delayed element moves by the learning rates of the steps it waited through, not by the rate of the step
    it arrives in (the memory of EF-SGD, Karimireddy et al., ICML 2019, and of Stich et al., NeurIPS 2018,
    holds ``γ_t·g_t``). ``lr_ref``: the first positive learning rate seen (the largest over parameter
    groups; in the per-rank checkpoint state). Matters where the learning rate changes within a delay:
    warm-ups, a decay to 0 over a short run. Off by default: it helped the 0.87 M LM on every run measured
    and not the 1.85 M GPT (both seeds end behind; docs/results.md). A step at learning rate 0 hands out 0 (what it
    sent is lost); late in a decay to 0 what is handed out grows like ``1 / w_t``, so gradient clipping can
    bite there; refused with fp16; a checkpoint loaded with this setting changed starts with empty residuals.
    false: the residual holds ``M_t`` (1-bit Adam, DGC)."""

    variance_refresh_decay: Optional[float] = Field(None, strict=True)
    """``ρ`` of each variance refresh, in [0.5, 1): the weight the frozen variance keeps. None (default):
    ``max(β2^variance_refresh_steps, 0.9)``, Adam's own decay over the interval, but at least 0.9: one step's
    squared gradient is a noisy, one-sample estimate (0 where that step's gradient is). At least 0.5 when set:
    ``sqrt(V̂)`` then falls by at most ~30 % per refresh."""

    selection: SelectionScope = SelectionScope.global_
    """``global``: one threshold over the whole flattened bucket, so the budget goes where the gradient mass
    is (measured better on the LM task: docs/results/convergence); tensors with small gradients are updated late.
    ``per_tensor``: each parameter's gradient in a bucket gets its own ``k = ceil(density · numel)``,
    threshold and hash table (DRAGONN paper, Sec. 4), in one kernel call per bucket, and small and 1-D
    tensors are sent whole (``tensor_min_compress_numel``, ``compress_1d``)."""

    tensor_min_compress_numel: int = Field(1024, ge=0, strict=True)
    """Per-tensor selection: parameters with fewer elements are sent whole (every element, as pairs in the
    same exchange; counted in the bytes)."""

    compress_1d: bool = Field(False, strict=True)
    """Per-tensor selection: false sends 1-D parameters (biases, norm weights) whole, as PowerSGD leaves them
    uncompressed; true compresses them like the others."""

    policy: Policy = Policy.auto
    """``auto``: per bucket, time the dense and the compressed reduction on the real link
    (``auto_probe_steps`` each), agree across ranks and compress only where it is faster; re-check every
    ``auto_recheck_interval`` steps. ``always``: compress every bucket (after the warm-up)."""

    auto_probe_steps: int = Field(3, ge=1, le=1000, strict=True)
    """Timed reductions of each kind (dense, compressed) per bucket before the auto decision."""

    auto_recheck_interval: int = Field(1000, ge=0, strict=True)
    """Reductions of a bucket between auto decisions, in steps (0: decide once)."""

    error_feedback: bool = Field(True, strict=True)
    """Keep what was not sent in a residual and add it back next step (nothing lost, only delayed)."""

    compressor: CompressorName = CompressorName.dragonn
    """Selection method: ``dragonn`` (product), ``topk`` or ``randomk`` (baselines for comparison)."""

    kernel: Kernel = Kernel.auto
    """DRAGONN selection implementation: ``auto`` (``triton`` for CUDA buffers, ``cpu`` for CPU buffers, falling
    back to ``reference``), ``reference``, ``cpu`` or ``triton``. All give identical selections for the same seed."""

    comm_backend: CommBackendName = CommBackendName.torch
    """Collectives: ``torch`` (deepspeed.comm; NCCL on GPU, gloo on CPU) or ``mpi`` (mpi4py)."""

    cuda_aware: bool = Field(False, strict=True)
    """MPI only: hand device buffers to MPI directly (true) or stage them through host memory (false)."""

    exchange: ExchangeScheme = ExchangeScheme.allgather
    """How the selected pairs are exchanged: ``allgather`` (each rank gathers all ranks' pairs: P·k pairs
    received per rank, fewest collectives; best for few ranks) or ``partitioned`` (each pair goes to the
    rank owning its index, owners re-sparsify their sum with a second residual and allgather it:
    about 2k(P−1)/P pairs per rank whatever the world size; best from ~4 ranks up)."""

    seed: int = Field(0, ge=0, lt=2**32, strict=True)
    """Base seed for threshold sampling and the hash; every rank advances it the same way each step."""

    log_interval: int = Field(0, ge=0, strict=True)
    """Log compression statistics every this many compressed steps on rank 0 (0 = never)."""

    comm_timeout_s: Optional[float] = Field(None, gt=0.0, le=7 * 86400.0, strict=True)
    """Seconds a collective of the data-parallel group may wait for the other ranks before it fails, so that
    a hung or dead rank ends the job with an error (``comm_backend`` ``torch``: the gloo/NCCL timeout of the
    world and data-parallel groups). None keeps DeepSpeed's: ``DEEPSPEED_TIMEOUT`` for the world group, and
    torch's default for the data-parallel group (30 min for gloo). With ``comm_backend`` ``mpi`` the exchange's
    mpi4py collectives are polled against it (None: they wait for ever)."""

    sync: SyncMode = SyncMode.every_step
    """``every_step``: every optimizer step's gradient is exchanged (compressed after the warm-ups).
    ``local_steps`` (ZeRO stage 0; fp32, bf16 or fp16): after the dense ``warmup_steps`` the ranks exchange nothing
    between syncs, each optimizer stepping on its own gradients, and every ``local_steps`` optimizer steps they
    run an outer step on the fp32 master weights (DiLoCo, Douillard et al. 2023; SparseLoCo, 2025): the
    pseudo-gradient ``Δ = θ_outer − θ_local`` plus its residual is DRAGONN-selected at ``density`` (a dense
    allreduce at density 1.0), averaged over the ranks, applied to ``θ_outer`` with ``outer_lr`` and
    ``outer_momentum``, and every rank restarts from ``θ_outer``. Each rank keeps its own inner optimizer state."""

    local_steps: int = Field(30, ge=1, le=1_000_000, strict=True)
    """``sync: local_steps``: optimizer steps per round (H), i.e. between two outer steps."""

    outer_lr: float = Field(1.0, gt=0.0, le=10.0, strict=True)
    """``sync: local_steps``: the outer learning rate applied to the averaged pseudo-gradient (SparseLoCo: 1.0;
    DiLoCo: 0.7 with Nesterov momentum 0.9)."""

    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0, strict=True)
    """``sync: local_steps``: Nesterov momentum of the outer SGD step (DiLoCo: 0.9); 0: plain outer SGD."""

    outer_feedback_decay: float = Field(1.0, ge=0.0, le=1.0, strict=True)
    """``sync: local_steps``: the pseudo-gradient residual is multiplied by this before each round's
    pseudo-gradient is added (SparseLoCo's decaying error-feedback accumulator); 1.0: nothing unsent is lost."""

    def given(self, *keys: str) -> list:
        """Those of ``keys`` the block sets explicitly, in the order given."""
        return [k for k in keys if k in self.model_fields_set]

    @field_validator("warmup_steps", "density_warmup_steps", mode="before")
    @classmethod
    def _check_steps_or_auto(cls, v: Any, info: ValidationInfo) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):  # one message, not the union's two
            raise ValueError(f"must be an integer >= 0 {_STEPS_OR_AUTO[info.field_name]}")
        return v

    @field_validator("variance_refresh_decay")
    @classmethod
    def _check_refresh_decay(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not 0.5 <= v < 1.0:  # (NaN fails too)
            raise ValueError("must be in [0.5, 1) (the weight the frozen variance keeps at a refresh), or null for "
                             "max(beta2^variance_refresh_steps, 0.9)")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> "DragonnConfig":
        self._check_sync()
        if self.selection == SelectionScope.per_tensor and self.exchange == ExchangeScheme.partitioned:
            raise ValueError("'selection': 'per_tensor' does not combine with 'exchange': 'partitioned' (its owners "
                             "re-select their part with one global threshold, so neither the per-tensor budgets nor "
                             "the tensors sent whole would reach the other ranks); use 'exchange': 'allgather' or "
                             "'selection': 'global'")
        if self.compress == CompressTarget.momentum and not self.error_feedback:
            raise ValueError("'compress': 'momentum' needs 'error_feedback': true (the momentum not sent is kept "
                             "in the residual; without it the update would lose ~(1 - density) of it every step)")
        if self.compress == CompressTarget.momentum and self.warmup_steps != "auto" and self.warmup_steps < 1:
            raise ValueError("'compress': 'momentum' needs 'warmup_steps' >= 1: Adam's variance is frozen from the "
                             "dense warm-up steps")
        if self.compress == CompressTarget.gradient:
            given = self.given(*MOMENTUM_KEYS)
            if given:
                raise ValueError(f"'{given[0]}' applies to 'compress': 'momentum' (or 'auto') only; remove it or "
                                 f"change 'compress'")
        if self.variance_refresh_steps == 1:
            raise ValueError("'variance_refresh_steps': 1 would refresh at every step and send no momentum; use 0 "
                             "(never) or at least 2")
        if self.variance_refresh_steps == 0 and self.variance_refresh_decay is not None:
            raise ValueError("'variance_refresh_decay' has no effect with 'variance_refresh_steps': 0 (no refresh); "
                             "remove one of them")
        if self.sync == SyncMode.local_steps and self.compress == CompressTarget.momentum:
            raise ValueError("'sync': 'local_steps' compresses the pseudo-gradient of each round; 'compress': "
                             "'momentum' applies to 'sync': 'every_step' only (remove it or use 'auto')")
        if self.cuda_aware and self.comm_backend != CommBackendName.mpi:
            raise ValueError(f"'cuda_aware': true only applies to 'comm_backend': 'mpi' "
                             f"(got 'comm_backend': '{self.comm_backend.value}')")
        return self

    def _check_sync(self) -> None:
        """Settings of one sync mode set under the other are refused (they would be ignored silently)."""
        local = self.sync == SyncMode.local_steps
        if not local:
            given = self.given("local_steps", "outer_lr", "outer_momentum", "outer_feedback_decay")
            if given:
                raise ValueError(f"'{given[0]}' applies to 'sync': 'local_steps' only; add \"sync\": \"local_steps\" "
                                 f"or remove it")
            return
        refresh = self.given(*MOMENTUM_KEYS)
        if refresh:
            raise ValueError(f"'{refresh[0]}' applies to 'sync': 'every_step' with 'compress': 'momentum' only; "
                             f"remove it")
        if self.freeze_adam_variance:
            raise ValueError("'freeze_adam_variance' applies to 'sync': 'every_step' only (with local steps each rank's "
                             "Adam runs unchanged on its own gradients)")
        if self.selection == SelectionScope.per_tensor:
            raise ValueError("'selection': 'per_tensor' applies to 'sync': 'every_step' only (the pseudo-gradient is "
                             "selected with one threshold over all the weights)")
        if self.outer_feedback_decay != 1.0 and not self.error_feedback:
            raise ValueError("'outer_feedback_decay' decays the pseudo-gradient residual, but 'error_feedback' is false "
                             "(there is none); remove one of them")

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any], None]) -> "DragonnConfig":
        """Read and validate the ``"dragonn"`` block of a DeepSpeed config (dict or JSON path).

        Returns a disabled config when the block is absent.

        Raises:
            DragonnConfigError: the block is null or not an object, has an unknown key or an invalid value.
        """
        cfg = load_ds_config(ds_config)
        if DRAGONN_KEY not in cfg:
            return cls()
        block = cfg[DRAGONN_KEY]
        if block is None:
            raise DragonnConfigError(f"'{DRAGONN_KEY}' is null; give an object such as "
                                     f'{{"enabled": false}} or {{"enabled": true, "density": 0.01}}, or remove the key')
        if not isinstance(block, Mapping):
            raise DragonnConfigError(f"'{DRAGONN_KEY}' must be a JSON object, got {type(block).__name__}: {block!r}")
        try:
            return cls(strict=True, **dict(block))
        except ValidationError as err:
            raise DragonnConfigError(_format_errors(err)) from None


def load_ds_config(ds_config: Union[str, os.PathLike, Mapping[str, Any], None]) -> dict:
    """Return a DeepSpeed config as a dict, accepting what ``deepspeed.initialize`` accepts.

    ``ds_config`` is a dict, a path to a JSON/HJSON file, a base64-encoded JSON string, or None (empty).
    Parsing is DeepSpeed's own (``runtime/tensor_parallel/init_utils.load_ds_config``).

    Raises:
        DragonnConfigError: the file is missing or cannot be parsed.
    """
    if ds_config is None:
        return {}
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config as ds_load
    text = os.fspath(ds_config)
    try:
        cfg = ds_load(text)
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises ValueError / hjson errors
        if not os.path.exists(text):
            raise DragonnConfigError(f"DeepSpeed config not found (not a file, nor a base64 JSON string): "
                                     f"{text[:200]}") from None
        raise DragonnConfigError(f"DeepSpeed config {text[:200]} cannot be parsed: {err}") from None
    if not isinstance(cfg, Mapping):
        raise DragonnConfigError(f"DeepSpeed config {text[:200]} is not a JSON object")
    return dict(cfg)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<block>"
        where = f"'{DRAGONN_KEY}.{key}'" if e["loc"] else f"'{DRAGONN_KEY}'"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(DragonnConfig.model_fields))
            close = difflib.get_close_matches(str(e["loc"][-1]), list(DragonnConfig.model_fields), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            lines.append(f"{where}: unknown key (value {e['input']!r}); {hint}allowed keys: {allowed}")
        elif not e["loc"]:  # a rule across keys: its message names them (the whole block is noise)
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: invalid value {e['input']!r}: {msg}")
    return "invalid 'dragonn' config block:\n  " + "\n  ".join(lines)
