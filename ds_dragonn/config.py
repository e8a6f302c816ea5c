"""The ``"dragonn"`` block of a DeepSpeed config, validated with pydantic.

The block sits at the top level of ``ds_config.json`` next to DeepSpeed's own sections (DeepSpeed keeps
unknown top-level keys in ``engine.config``)::

    "dragonn": {"enabled": true, "density": 0.01}

Validation follows DeepSpeed's ``runtime/config_utils.DeepSpeedConfigModel``: unknown keys are rejected, every field
is typed and bounded; the checks across fields are the ``config`` rows of ``ds_dragonn.plan.RULES``. Errors
surface as :class:`DragonnConfigError`, naming the key, the value given and what is allowed. See docs/config.md.
"""
from __future__ import annotations

import difflib
import json
import os
from enum import Enum
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, Field, StrictInt, ValidationError, ValidationInfo, computed_field, field_validator, model_validator
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from .exchange.quantize import ValueFormat

from .plan import MOMENTUM_KEYS, Facts, check  # noqa: F401 - MOMENTUM_KEYS: read here by its old name

DRAGONN_KEY = "dragonn"


class DragonnConfigError(ValueError):
    """Raised when the ``"dragonn"`` block is invalid; the message names the key, value and what is allowed."""


class CommBackendName(str, Enum):
    torch = "torch"  # deepspeed.comm: NCCL on GPU, gloo on CPU
    mpi = "mpi"  # mpi4py


class ExchangeScheme(str, Enum):
    allgather = "allgather"  # every rank gathers every rank's (index, value) pairs (DRAGONN paper, Sec. 4)
    partitioned = "partitioned"  # sparse reduce-scatter to balanced owners + server residual + allgather


class Hierarchy(str, Enum):
    auto = "auto"  # node when the launcher reports several nodes of several ranks each, else flat (logged)
    flat = "flat"  # every rank selects over the whole bucket and exchanges with every rank
    node = "node"  # dense reduce-scatter inside the node, compressed exchange across nodes, allgather inside


class Policy(str, Enum):
    auto = "auto"  # compress a bucket only where it measured faster than the dense allreduce
    always = "always"  # compress every bucket above min_compress_numel after the warm-up


class CompressTarget(str, Enum):
    auto = "auto"  # momentum for an Adam-type optimizer with decoupled weight decay, else gradient
    gradient = "gradient"  # the gradient, with error feedback (DRAGONN paper)
    momentum = "momentum"  # each rank's local momentum, with error feedback; Adam's variance frozen (1-bit Adam)


class SelectionMode(str, Enum):
    global_ = "global"  # one threshold over the whole bucket: the budget goes where the gradient mass is
    chunked = "chunked"  # every chunk of CHUNK_SIZE entries sends its own top-k (SparseLoCo; compress/chunks.py)


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
                            "(max(100, 3 x the dense warm-up, 1 / density))",
}


class AdvancedConfig(BaseModel):
    """``"advanced"``: benchmark and research settings. Leave them out: the defaults are the product. (A plain
    pydantic model: DeepSpeedConfigModel's non-strict ``__init__`` would drop "auto" values silently.)"""

    model_config = {"extra": "forbid", "validate_assignment": True, "use_enum_values": False,
                    "populate_by_name": True, "allow_inf_nan": False}

    kernel: Kernel = Kernel.auto
    """DRAGONN implementation: ``auto`` (``triton`` on CUDA, ``cpu`` on CPU, else ``reference``), ``reference``,
    ``cpu`` or ``triton``; all give identical selections."""

    error_feedback: bool = Field(True, strict=True)
    """Keep what was not sent in a residual and add it back next step (nothing lost, only delayed)."""

    density_warmup_start: float = Field(0.25, gt=0.0, le=1.0, strict=True)
    """Density of the first compressed step of the density warm-up (DGC: 0.25); at or below ``density``: none."""

    variance_refresh_steps: int = Field(100, ge=0, strict=True)
    """``compress: momentum``: every this many steps one dense raw-gradient step refreshes Adam's frozen
    variance (0/1 Adam, Lu et al. 2022); it applies no update (its momentum waits in the residual). 0: never."""

    cuda_aware: bool = Field(False, strict=True)
    """``comm_backend: mpi`` only: hand device buffers to MPI directly (true) or stage them through host memory."""

    ranks_per_node: Optional[int] = Field(None, ge=1, strict=True)
    """Ranks per node for ``hierarchy`` (None: the launcher's ``LOCAL_SIZE``); ranks must be laid out node by
    node (ranks ``i·L … i·L + L − 1`` on node ``i``), as the deepspeed launcher assigns them."""

    values: ValueFormat = ValueFormat.auto
    """How the selected values travel: ``dtype`` (the communication dtype), or ``int8`` / ``int4``: symmetric codes,
    one float32 absmax scale per 64 values (ZeRO++ qgZ; SparseLoCo); the rounding stays in the residual
    (exchange/quantize.py). ``auto``: ``int4`` at density <= 0.1, else ``dtype`` (``plan.resolve_defaults``)."""

    dense_values: ValueFormat = ValueFormat.auto
    """ZeRO stage 0, ``sync: every_step``: how the dense steps' gradients travel. ``dtype``: DeepSpeed's allreduce
    in the communication dtype; ``int8`` / ``int4``: a quantized reduce-scatter and allgather (ZeRO++ qgZ), the
    rounding kept in a residual (exchange/dense_quantized.py). ``auto``: ``dtype`` (int4 dense steps cost the GPT
    +3.0 % on one seed of two: docs/results.md, "Defaults that follow the density")."""

    selection: SelectionMode = SelectionMode.global_
    """``global``: one threshold over each bucket. ``chunked``: every chunk of ``constants.CHUNK_SIZE`` (4096) entries
    sends its own top ``≈ density × 4096`` (SparseLoCo, Sarfi et al. 2025), the same ``k`` in all; per-step
    modes, every ZeRO stage, the partitioned owners and local steps' Δ (compress/chunks.py)."""

    max_age: Union[Literal["auto"], StrictInt] = "auto"
    """Age bound: every entry of a bucket is sent at least once every ``max_age`` compressed steps (local steps:
    rounds): each compressed step also sends one of ``max_age`` contiguous blocks whole (compress/age_bound.py).
    0: no bound. ``auto``: ``round(0.3 / density)`` at density <= 0.002 with ``sync: every_step``, else 0."""

    exact_skipped_steps: Optional[bool] = Field(None, strict=True)
    """What a step DeepSpeed skips on overflow leaves. ``true``: nothing (working copies of every residual and
    local momentum). ``false``: what the step sent returns to the residuals (an O(k) log). ``None`` (default):
    ``true`` under the fp16 loss scaler, else ``false`` (steps.py; docs/design.md, 'Around the step')."""

    @field_validator("max_age", mode="before")
    @classmethod
    def _check_age_or_auto(cls, v: Any) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):  # one message, not the union's
            raise ValueError('must be an integer >= 0 (0: no bound), or "auto" (round(0.3 / density) at density '
                             '<= 0.002, else 0)')
        return v

    @field_validator("variance_refresh_steps", "max_age")
    @classmethod
    def _zero_or_at_least_two(cls, v: int, info: ValidationInfo) -> int:
        if v == 1:
            raise ValueError(_WHY_NOT_ONE[info.field_name])
        return v


#: Why 1 is refused for the keys that take 0 (off) or at least 2.
_WHY_NOT_ONE = {
    "variance_refresh_steps": "1 would refresh at every step and send no momentum; use 0 (never) or at least 2",
    "max_age": "1 would send every entry at every step (density 1); use 0 (no bound) or at least 2",
}


ADVANCED_KEYS = tuple(AdvancedConfig.model_fields)


def _json(value: Any) -> str:
    """``value`` as JSON where it can be (the block's own syntax), else its repr."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _refuse_misplaced_keys(data: Any) -> Any:
    """``data``, or ValueError naming the first advanced key it sets at the top level, or the first key of
    ``advanced`` that is not a string or is a top-level key (and where each belongs)."""
    if not isinstance(data, Mapping):
        return data
    for key in data:
        if key in ADVANCED_KEYS:
            raise ValueError(f"'{DRAGONN_KEY}.{key}' belongs under 'advanced': write \"advanced\": "
                             f"{{{json.dumps(key)}: {_json(data[key])}}} (docs/config.md#advanced)")
    advanced = data.get("advanced")
    if isinstance(advanced, Mapping):
        for key in advanced:
            if not isinstance(key, str):
                raise ValueError(f"'{DRAGONN_KEY}.advanced' keys are strings; got the key {key!r}")
            if key in DragonnConfig.model_fields and key != "advanced":
                raise ValueError(f"'{DRAGONN_KEY}.advanced.{key}' is a top-level key of the block: write "
                                 f"\"{key}\": {_json(advanced[key])} beside \"enabled\" (docs/config.md)")
    return data


def _delegate(name: str, doc: str) -> property:
    """A read-only ``cfg.<name>`` answering ``cfg.advanced.<name>`` (engine code reads it as before)."""
    return computed_field(property(lambda self: getattr(self.advanced, name), doc=doc), return_type=Any)


class DragonnConfig(DeepSpeedConfigModel):
    """Settings of DRAGONN gradient compression (all optional; docs/config.md gives the reason for each default)."""

    # strict scalars: "true" or 1 is not a bool, true is not a density, "0.5" is not a number
    model_config = {"extra": "forbid", "validate_assignment": True, "use_enum_values": False,
                    "populate_by_name": True, "allow_inf_nan": False}

    enabled: bool = Field(False, strict=True)
    """Switch compression on. When false (or the block is absent) the engine is not touched."""

    density: float = Field(0.01, gt=0.0, le=1.0, strict=True)
    """Fraction of a bucket's elements kept per step, ``k = ceil(density * numel)``. 1.0 keeps everything."""

    warmup_steps: Union[Literal["auto"], StrictInt] = "auto"
    """Dense optimizer steps before compression starts; Adam's variance is estimated from them (the momentum
    mode). ``"auto"``: twice the engine's learning-rate warm-up, at least 30 (engine/warmup.py). 0: none, and
    ``compress: auto`` then picks the gradient mode (logged)."""

    density_warmup_steps: Union[Literal["auto"], StrictInt] = "auto"
    """Steps after ``warmup_steps`` over which the density falls exponentially from 0.25 to ``density`` (DGC,
    Lin et al. 2018). ``"auto"``: ``max(100, 3 × warmup_steps, ⌈1 / density⌉)`` (schedule.py). 0: none."""

    compress: CompressTarget = CompressTarget.auto
    """What is sparsified: ``momentum`` (each rank's local momentum, Adam's variance frozen between refreshes:
    1-bit Adam's structure) or ``gradient``. ``auto``: ``momentum`` for Adam-type optimizers with decoupled or no
    weight decay, a dense warm-up and error feedback, else ``gradient`` (logged with the reason)."""

    policy: Policy = Policy.auto
    """``auto``: per bucket, time the dense and the compressed reduction on the real link, agree across ranks and
    compress only where faster. ``always``: compress every bucket after the warm-up."""

    exchange: ExchangeScheme = ExchangeScheme.allgather
    """``allgather`` (P·k pairs received per rank; few ranks) or ``partitioned`` (sparse reduce-scatter to
    hash-balanced owners, then allgather: ~2k(P−1)/P pairs per rank; from ~4 ranks up). ZeRO 0 only."""

    min_compress_numel: int = Field(1 << 16, ge=0, strict=True)
    """Buckets with fewer elements go through DeepSpeed's dense reduction."""

    hierarchy: Hierarchy = Hierarchy.auto
    """``node``: sum each bucket densely inside the node, compress one shard per rank across nodes, gather it
    back inside the node (under ``sync: local_steps`` each node is one worker). ``flat``: every rank exchanges with
    every rank. ``auto``: ``node`` on several nodes of several ranks, else ``flat`` (logged)."""

    comm_backend: CommBackendName = CommBackendName.torch
    """Collectives: ``torch`` (deepspeed.comm; NCCL on GPU, gloo on CPU) or ``mpi`` (mpi4py)."""

    comm_timeout_s: Optional[float] = Field(None, ge=1.0, le=7 * 86400.0, strict=True)
    """Seconds a collective may wait for the other ranks before it fails (a hung or dead rank ends the job).
    None: DeepSpeed's/torch's default (30 min for gloo); under ``mpi`` it waits for ever. May differ per rank. At
    least 1 s: below, the rendezvous itself times out (torch's error does not name this key)."""

    log_interval: int = Field(0, ge=0, strict=True)
    """A statistics line on rank 0 every this many compressed reductions (``sync: local_steps``: outer steps);
    0: never. May differ per rank."""

    sync: SyncMode = SyncMode.every_step
    """``every_step``: every step's gradient is exchanged. ``local_steps`` (ZeRO 0): ranks step alone and every
    ``local_steps`` steps exchange a DRAGONN-selected pseudo-gradient of the fp32 weights (DiLoCo / SparseLoCo)."""

    local_steps: int = Field(30, ge=1, le=1_000_000, strict=True)
    """``sync: local_steps``: optimizer steps per round (H), i.e. between two outer steps."""

    outer_lr: Union[Literal["auto"], float] = "auto"
    """``sync: local_steps``: the outer SGD's learning rate on the averaged pseudo-gradient, 0 < lr <= 10.
    ``"auto"``: the square root of the workers, at least 2 for a compressed Δ (density < 1; outer.py)."""

    advanced: AdvancedConfig = Field(default_factory=AdvancedConfig)
    """Benchmark and research settings (:class:`AdvancedConfig`)."""

    @field_validator("advanced", mode="before")
    @classmethod
    def _check_advanced_object(cls, v: Any) -> Any:
        if not isinstance(v, (Mapping, AdvancedConfig)):
            raise ValueError('must be a JSON object of advanced settings, e.g. {"kernel": "cpu"} (or leave it out)')
        return v

    kernel = _delegate("kernel", "``advanced.kernel``.")
    error_feedback = _delegate("error_feedback", "``advanced.error_feedback``.")
    density_warmup_start = _delegate("density_warmup_start", "``advanced.density_warmup_start``.")
    variance_refresh_steps = _delegate("variance_refresh_steps", "``advanced.variance_refresh_steps``.")
    cuda_aware = _delegate("cuda_aware", "``advanced.cuda_aware``.")
    ranks_per_node = _delegate("ranks_per_node", "``advanced.ranks_per_node``.")
    values = _delegate("values", "``advanced.values``.")
    selection = _delegate("selection", "``advanced.selection``.")
    dense_values = _delegate("dense_values", "``advanced.dense_values``.")
    max_age = _delegate("max_age", "``advanced.max_age``.")
    exact_skipped_steps = _delegate("exact_skipped_steps", "``advanced.exact_skipped_steps``.")

    def given(self, *keys: str) -> list:
        """Those of ``keys`` the block sets explicitly, in the order given; an advanced key as ``advanced.<key>``."""
        top, adv = self.model_fields_set, self.advanced.model_fields_set
        return [k if k in top else f"advanced.{k}" for k in keys if k in top or (k in ADVANCED_KEYS and k in adv)]

    @model_validator(mode="before")
    @classmethod
    def _refuse_misplaced(cls, data: Any) -> Any:
        return _refuse_misplaced_keys(data)

    @field_validator("warmup_steps", "density_warmup_steps", mode="before")
    @classmethod
    def _check_steps_or_auto(cls, v: Any, info: ValidationInfo) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):  # one message, not the union's two
            raise ValueError(f"must be an integer >= 0 {_STEPS_OR_AUTO[info.field_name]}")
        return v

    @field_validator("outer_lr", mode="before")
    @classmethod
    def _check_outer_lr(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v <= 10.0:  # NaN fails too
            raise ValueError("must be a finite number with 0 < lr <= 10, or \"auto\" (the square root of the "
                             "workers, at least 2 below density 1)")
        return float(v)

    @model_validator(mode="after")
    def _check_combinations(self) -> "DragonnConfig":
        check(self, Facts(), "config", error=ValueError)  # the "config" rows of plan.RULES
        return self

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any], None]) -> "DragonnConfig":
        """Read and validate the ``"dragonn"`` block of a DeepSpeed config (dict or JSON path).

        Returns a disabled config when the block is absent.

        Raises:
            DragonnConfigError: the block is null or not an object, has an unknown or misplaced key or an invalid value.
        """
        cfg = load_ds_config(ds_config)
        if DRAGONN_KEY not in cfg:
            near = [k for k in cfg if isinstance(k, str) and difflib.get_close_matches(k.lower(), [DRAGONN_KEY], 1, 0.8)]
            if near:  # e.g. "Dragonn", "dragon": DeepSpeed ignores it, so the run would be silently dense
                from deepspeed.utils import logger
                logger.warning(f"DRAGONN: the DeepSpeed config has a key {near[0]!r} but no {DRAGONN_KEY!r}: "
                               f"compression is off. Did you mean {DRAGONN_KEY!r}?")
            return cls()
        block = cfg[DRAGONN_KEY]
        if block is None:
            raise DragonnConfigError(f"'{DRAGONN_KEY}' is null; give an object such as "
                                     f'{{"enabled": false}} or {{"enabled": true, "density": 0.01}}, or remove the key')
        if not isinstance(block, Mapping):
            raise DragonnConfigError(f"'{DRAGONN_KEY}' must be a JSON object, got {type(block).__name__}: {block!r}")
        odd = [k for k in block if not isinstance(k, str)]
        if odd:
            raise DragonnConfigError(f"'{DRAGONN_KEY}' keys are strings; got the key {odd[0]!r} ({type(odd[0]).__name__})")
        clash = [k for k in ("strict", "self") if k in block]  # the names of __init__'s own arguments
        if clash:
            raise DragonnConfigError(f"invalid 'dragonn' config block:\n  '{DRAGONN_KEY}.{clash[0]}': unknown key "
                                     f"(value {block[clash[0]]!r}); allowed keys: "
                                     + ", ".join(sorted(DragonnConfig.model_fields)))
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
            fields = list(AdvancedConfig.model_fields if len(e["loc"]) > 1 else DragonnConfig.model_fields)
            allowed = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(e["loc"][-1]), fields, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            lines.append(f"{where}: unknown key (value {e['input']!r}); {hint}allowed keys: {allowed}")
        elif e["msg"].startswith(f"Value error, '{DRAGONN_KEY}."):  # a misplaced key: the message is whole
            lines.append(e["msg"].removeprefix("Value error, "))
        elif not e["loc"]:  # a rule across keys: its message names them (the whole block is noise)
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: invalid value {e['input']!r}: {msg}")
    return "invalid 'dragonn' config block:\n  " + "\n  ".join(lines)
