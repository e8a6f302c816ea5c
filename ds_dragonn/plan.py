"""The plan of a run: which mode runs and why, and the one table of supported combinations.

``initialize`` resolves a :class:`Plan` once (:func:`resolve`) from the ``"dragonn"`` block and what it knows
of the engine (:class:`Facts`), after checking the block against :data:`RULES`: every combination of
settings that ds_dragonn refuses is one row there, with the message that names the key and value. Checks of
one field alone (type, range, choice) stay in ``config.py``'s pydantic model.

A row is checked in the phases it names:

- ``config``: the block alone, while pydantic validates it (the error is a ``DragonnConfigError``);
- ``start``: the block and the DeepSpeed config, before DeepSpeed starts;
- ``engine``: the engine DeepSpeed built (its optimizer), before a hook is installed;
- ``layout``: the hook's data-parallel group, when its pipeline is built (``engine/pipelines.py``).

This module imports nothing from the package when it loads (``config.py`` and ``engine/`` read it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from pydantic import TypeAdapter, ValidationError

#: the momentum mode's own settings (refused or ignored where that mode does not run)
MOMENTUM_KEYS = ("variance_refresh_steps",)
#: the local-steps mode's own settings
LOCAL_STEPS_KEYS = ("local_steps", "outer_lr")
#: where ``"enabled": true`` has no effect on a ZeRO-offload key (``{"device": "none"}`` is no offload)
_OFFLOAD_KEYS = {1: ("offload_optimizer", "offload_param", "cpu_offload"),
                 2: ("offload_optimizer", "offload_param", "cpu_offload"),
                 3: ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param")}
PHASES = ("config", "start", "engine", "layout")


_BOOL = TypeAdapter(bool)


def flag(value: Any, default: bool) -> bool:
    """A DeepSpeed config switch as DeepSpeed reads it (its config models are pydantic: ``"false"``, ``0``,
    ``"off"`` are false); ``default`` where it is absent (None) or not a boolean (DeepSpeed refuses that itself)."""
    if value is None:
        return default
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return default


class DragonnUnsupportedError(ValueError):
    """DRAGONN was enabled with a DeepSpeed setting it does not support; the message names the key and value
    (every case is a row of :data:`ds_dragonn.plan.RULES`)."""


@dataclass(frozen=True)
class Facts:
    """What the rules need to know beyond the ``"dragonn"`` block. Fields left None are not known yet in
    the phase checked (a row that needs one does not apply).

    Attributes:
        stage: the ZeRO stage (-1: unreadable; DeepSpeed refuses it itself).
        zero: the ``zero_optimization`` dict ({} for the legacy bool/int form).
        ds_config: the whole DeepSpeed config.
        pipeline_model: the model is a ``deepspeed.pipe.PipelineModule``.
        reduce_scatter / contiguous_gradients: ZeRO's switches (the config's keys at start, read as DeepSpeed
            reads them: :func:`flag`; the optimizer's attributes once built).
        optimizer: the class name of the engine's optimizer (the ZeRO wrapper where there is one).
        hooked_optimizer: the optimizer has the methods the stage's hook replaces.
        momentum_refusal: why the momentum mode cannot serve the optimizer ("" where it can).
        bf16_optimizer: DeepSpeed runs its ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation).
        may_skip_steps: DeepSpeed may skip a step on overflow (fp16, or bf16 with overflow checks).
        loss_scaler: DeepSpeed runs the fp16 loss scaler (whose skipped steps are routine).
        device: the engine's device type (``"cuda"``, ``"cpu"``, ...).
        hook_name / supports_hierarchy / dp_world / world: the hook and its data-parallel group (layout phase).
    """
    stage: int = 0
    zero: Mapping[str, Any] = field(default_factory=dict)
    ds_config: Mapping[str, Any] = field(default_factory=dict)
    pipeline_model: bool = False
    reduce_scatter: Optional[bool] = None
    contiguous_gradients: Optional[bool] = None
    optimizer: Optional[str] = None
    hooked_optimizer: Optional[bool] = None
    momentum_refusal: Optional[str] = None
    bf16_optimizer: Optional[bool] = None
    may_skip_steps: Optional[bool] = None
    loss_scaler: Optional[bool] = None
    device: Optional[str] = None
    hook_name: Optional[str] = None
    supports_hierarchy: Optional[bool] = None
    dp_world: Optional[int] = None
    world: Optional[int] = None

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any], pipeline_model: bool = False) -> "Facts":
        """The facts known before DeepSpeed starts."""
        zero = ds_config.get("zero_optimization") or {}
        zero = zero if isinstance(zero, Mapping) else {}
        return cls(stage=zero_stage(ds_config.get("zero_optimization") or {}), zero=zero, ds_config=ds_config,
                   pipeline_model=pipeline_model, reduce_scatter=flag(zero.get("reduce_scatter"), True),
                   contiguous_gradients=flag(zero.get("contiguous_gradients"), True))

    def updated(self, **changes: Any) -> "Facts":
        return dataclasses.replace(self, **changes)


def zero_stage(zero: Any) -> int:
    """The ZeRO stage of a ``zero_optimization`` value (dict, or the legacy bool/int form); -1 if unreadable."""
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage is True:
        return 1
    try:
        return int(stage or 0)
    except (TypeError, ValueError):
        return -1


def node_unsupported(f: Facts) -> Optional[str]:
    """Why the node-aware exchange cannot run for this hook and group (layout phase), or None."""
    if f.dp_world is not None and f.dp_world <= 1:
        return "one rank"
    if f.supports_hierarchy is False:
        return f"the node-aware exchange does not run under {f.hook_name}"
    if f.dp_world is not None and f.world is not None and f.dp_world != f.world:
        return (f"the data-parallel group ({f.dp_world} ranks) is not the world ({f.world}): model or sequence "
                f"parallelism")
    return None


def _offload(f: Facts) -> Optional[Tuple[str, Any]]:
    for key in _OFFLOAD_KEYS.get(f.stage, ()):
        value = f.zero.get(key)
        if value and (not isinstance(value, Mapping) or value.get("device", "cpu") not in (None, "none")):
            return key, value
    return None


def _bf16_fp32_accum(f: Facts) -> bool:
    if f.stage == 1 and f.bf16_optimizer:  # the engine phase: what DeepSpeed built
        return True
    block = f.ds_config.get("bf16") or {}
    bf16 = flag(block.get("enabled"), False) if isinstance(block, Mapping) else False
    types = f.ds_config.get("data_types")  # (not an object: DeepSpeed refuses it itself)
    accum = str(types.get("grad_accum_dtype", "") if isinstance(types, Mapping) else "").lower().replace("torch.", "")
    return f.stage == 1 and bf16 and accum in ("fp32", "float32", "float") and not f.zero.get("offload_optimizer")


def _offload_message(stage: int, key: str, value: Any) -> str:
    if stage == 3:
        return _zero3(f"'zero_optimization.{key}' ({value!r}: ZeRO-Infinity / offload)")
    return (f"'dragonn' with ZeRO stage {stage} does not support 'zero_optimization.{key}' ({value!r}): remove it, "
            f"or set 'dragonn.enabled' to false")


def _zero3(what: str) -> str:
    return f"'dragonn' with ZeRO stage 3 does not support {what}; remove it, or set 'dragonn.enabled' to false"


@dataclass(frozen=True)
class Rule:
    """One unsupported combination: refused in ``phases`` where ``when(cfg, facts)`` holds, with
    ``message(cfg, facts)`` (which names the key and value)."""
    name: str
    phases: Tuple[str, ...]
    when: Callable[[Any, Facts], Any]
    message: Callable[[Any, Facts], str]


def _triton_interpret() -> bool:
    from .compress.kernels import triton_interpret  # imported when the row is checked, not with this module
    return triton_interpret()


def _quantized_dense(cfg: Any) -> bool:
    from .exchange.quantize import value_codec  # imported when the row is checked, not with this module
    return value_codec(cfg.dense_values).quantized


def _given_local(cfg: Any) -> List[str]:
    return cfg.given(*LOCAL_STEPS_KEYS)


#: every cross-field / cross-engine refusal, in the order checked
RULES: Tuple[Rule, ...] = (
    # --- the block alone -------------------------------------------------------------------------------
    Rule("momentum_needs_error_feedback", ("config",),
         lambda c, f: c.compress == "momentum" and not c.error_feedback,
         lambda c, f: "'compress': 'momentum' needs 'advanced.error_feedback': true (the momentum not sent is kept "
                      "in the residual; without it the update would lose ~(1 - density) of it every step)"),
    Rule("momentum_needs_warmup", ("config",),
         lambda c, f: c.compress == "momentum" and c.warmup_steps != "auto" and c.warmup_steps < 1,
         lambda c, f: "'compress': 'momentum' needs 'warmup_steps' >= 1: Adam's variance is frozen from the "
                      "dense warm-up steps"),
    Rule("momentum_keys_with_gradient", ("config",),
         lambda c, f: c.compress == "gradient" and c.given(*MOMENTUM_KEYS),
         lambda c, f: f"'{c.given(*MOMENTUM_KEYS)[0]}' applies to 'compress': 'momentum' (or 'auto') only; remove it "
                      f"or change 'compress'"),
    Rule("local_steps_keys_every_step", ("config",),
         lambda c, f: c.sync != "local_steps" and _given_local(c),
         lambda c, f: f"'{_given_local(c)[0]}' applies to 'sync': 'local_steps' only; add \"sync\": \"local_steps\" "
                      f"or remove it"),
    Rule("dense_values_local_steps", ("config",),
         lambda c, f: c.sync == "local_steps" and _quantized_dense(c),
         lambda c, f: f"'advanced.dense_values': '{_v(c.dense_values)}' applies to 'sync': 'every_step' only (local "
                      f"steps' dense warm-up is DeepSpeed's allreduce, and their rounds send the pseudo-gradient at "
                      f"'density'); remove it"),
    Rule("momentum_keys_local_steps", ("config",),
         lambda c, f: c.sync == "local_steps" and c.given(*MOMENTUM_KEYS),
         lambda c, f: f"'{c.given(*MOMENTUM_KEYS)[0]}' applies to 'sync': 'every_step' with 'compress': 'momentum' "
                      f"only; remove it"),
    Rule("momentum_local_steps", ("config",),
         lambda c, f: c.sync == "local_steps" and c.compress == "momentum",
         lambda c, f: "'sync': 'local_steps' compresses the pseudo-gradient of each round; 'compress': "
                      "'momentum' applies to 'sync': 'every_step' only (remove it or use 'auto')"),
    Rule("ranks_per_node_flat", ("config",),
         lambda c, f: c.ranks_per_node is not None and c.hierarchy == "flat",
         lambda c, f: "'advanced.ranks_per_node' has no effect with 'hierarchy': 'flat'; remove it"),
    Rule("cuda_aware_without_mpi", ("config",),
         lambda c, f: c.cuda_aware and c.comm_backend != "mpi",
         lambda c, f: f"'advanced.cuda_aware': true only applies to 'comm_backend': 'mpi' "
                      f"(got 'comm_backend': '{getattr(c.comm_backend, 'value', c.comm_backend)}')"),
    # --- the block and the DeepSpeed config, before DeepSpeed starts ---------------------------------------
    Rule("local_steps_zero", ("start",),
         lambda c, f: c.sync == "local_steps" and f.stage != 0,
         lambda c, f: f"'dragonn.sync': 'local_steps' needs every rank's own full optimizer state and fp32 weights "
                      f"(each rank steps alone between syncs); ZeRO stage {f.stage} partitions them across the ranks. "
                      f"Use 'zero_optimization.stage': 0, or 'sync': 'every_step'"),
    Rule("dense_values_zero", ("start",),
         lambda c, f: f.stage != 0 and _quantized_dense(c),
         lambda c, f: f"'dragonn.advanced.dense_values': '{_v(c.dense_values)}' applies to ZeRO stage 0 only (at "
                      f"stage {f.stage} the dense steps are DeepSpeed's own reduce-scatter); remove it"),
    Rule("pipeline_engine", ("start",),
         lambda c, f: f.pipeline_model,
         lambda c, f: "'dragonn' does not support the pipeline engine (PipelineModule model)"),
    Rule("offload", ("start",),
         lambda c, f: f.stage in (1, 2, 3) and _offload(f),
         lambda c, f: _offload_message(f.stage, *_offload(f))),
    Rule("reduce_scatter_off", ("start", "engine"),
         lambda c, f: f.stage in (1, 2, 3) and f.reduce_scatter is False,
         lambda c, f: f"'dragonn' with ZeRO stage {f.stage} compresses the gradient reduce-scatter, but "
                      f"'zero_optimization.reduce_scatter' is false (a dense allreduce the hook does not see); "
                      f"remove the key or set it to true"),
    Rule("zero1_bf16_fp32_accum", ("start", "engine"),
         lambda c, f: _bf16_fp32_accum(f),
         lambda c, f: "'dragonn' with ZeRO stage 1, bf16 and 'data_types.grad_accum_dtype': 'fp32': DeepSpeed runs "
                      "its BF16_Optimizer there, whose gradient reduction ds_dragonn does not hook. Use ZeRO stage 2 "
                      "(which supports fp32 accumulation) or drop 'grad_accum_dtype'"),
    Rule("contiguous_gradients_off", ("start", "engine"),
         lambda c, f: f.stage in (1, 2) and f.contiguous_gradients is False,
         lambda c, f: f"'dragonn' with ZeRO stage {f.stage} compresses the contiguous gradient buckets; "
                      f"'zero_optimization.contiguous_gradients' is false (DeepSpeed then reduces gradient lists "
                      f"through another path, which would stay dense). Remove the key or set it to true"),
    Rule("zero3_quantized_gradients", ("start",),
         lambda c, f: f.stage == 3 and flag(f.zero.get("zero_quantized_gradients"), False),
         lambda c, f: _zero3("'zero_optimization.zero_quantized_gradients' (qgZ compresses the same "
                             "reduce-scatter)")),
    Rule("zero3_zenflow", ("start",),
         lambda c, f: f.stage == 3 and f.zero.get("zenflow"),
         lambda c, f: _zero3("'zero_optimization.zenflow' (ZenFlow's selective updates on offloaded optimizer "
                             "states)")),
    Rule("zero3_predivide", ("start",),
         lambda c, f: f.stage == 3 and f.ds_config.get("gradient_predivide_factor", 1.0) != 1.0,
         lambda c, f: _zero3(f"'gradient_predivide_factor' ({f.ds_config['gradient_predivide_factor']!r}: ZeRO-3 "
                             f"then scales the reduce-scatter in a way the hook does not reproduce, and would leave "
                             f"it dense)")),
    # --- the engine DeepSpeed built ---------------------------------------------------------------------
    Rule("unhooked_optimizer", ("engine",),
         lambda c, f: c.sync != "local_steps" and f.stage != 0 and f.hooked_optimizer is False,
         lambda c, f: (f"'dragonn' at ZeRO stage 3 hooks DeepSpeedZeroOptimizer_Stage3; the engine runs {f.optimizer}"
                       if f.stage == 3 else f"'dragonn' supports ZeRO stages 0-3; the engine runs stage {f.stage} "
                                            f"with {f.optimizer}")),
    Rule("kernel_device", ("engine",),
         lambda c, f: _v(c.kernel) == "triton" and f.device is not None and f.device != "cuda"
         and not (f.device == "cpu" and _triton_interpret()),
         lambda c, f: f"'dragonn.advanced.kernel': 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                      f"the engine runs on {f.device}. Use 'auto' (the C++ library on CPU) or 'cpu'"),
    Rule("momentum_optimizer", ("engine",),
         lambda c, f: c.compress == "momentum" and c.sync != "local_steps" and f.momentum_refusal,
         lambda c, f: f"'dragonn.compress': 'momentum' {f.momentum_refusal}. Use 'compress': 'gradient' with it"),
    Rule("local_steps_bf16_optimizer", ("engine",),
         lambda c, f: c.sync == "local_steps" and f.bf16_optimizer,
         lambda c, f: "'dragonn.sync': 'local_steps' needs every rank's full fp32 master weights, but this engine "
                      "runs DeepSpeed's BF16_Optimizer (bf16 with 'data_types.grad_accum_dtype': 'fp32'), which "
                      "partitions them across the ranks. Drop 'grad_accum_dtype' or use 'sync': 'every_step'"),
    # --- the hook's data-parallel group -----------------------------------------------------------------
    Rule("node_layout", ("layout",),
         lambda c, f: c.hierarchy == "node" and node_unsupported(f),
         lambda c, f: f"'dragonn.hierarchy': 'node': {node_unsupported(f)}; use 'hierarchy': 'flat' or 'auto'"),
)


def refusal(cfg: Any, facts: Facts, phase: str) -> Optional[Tuple[Rule, str]]:
    """The first row of :data:`RULES` checked in ``phase`` that refuses ``cfg`` with ``facts``, and its
    message; None where none does."""
    assert phase in PHASES, phase
    for rule in RULES:
        if phase in rule.phases and rule.when(cfg, facts):
            return rule, rule.message(cfg, facts)
    return None


def check(cfg: Any, facts: Facts, phase: str, error: type = DragonnUnsupportedError) -> None:
    """Raise ``error`` with the message of the first row that refuses ``cfg`` in ``phase``."""
    found = refusal(cfg, facts, phase)
    if found is not None:
        raise error(found[1])


def _v(x: Any) -> Any:
    return getattr(x, "value", x)


@dataclass(frozen=True)
class Plan:
    """Which mode runs, resolved once at ``initialize``; ``reasons`` says why for each resolved ``"auto"``
    (and for what the engine decided). Read by the hook as ``engine.dragonn.plan``.

    Attributes:
        stage: ZeRO stage 0-3.
        sync: ``"every_step"`` or ``"local_steps"``.
        compress: ``"gradient"`` or ``"momentum"`` (``"auto"`` resolved).
        layout: ``"flat"`` or ``"node"`` once the hook built its pipeline (``"auto"`` until then).
        exchange: the sparse exchange scheme (``"allgather"`` / ``"partitioned"``; ZeRO 1-3 reduce-scatter).
        density: the density of the compressed steps (local steps: of the Δ).
        values / dense_values: the value formats of the compressed / the dense steps (``"dtype"``, and
            ``"auto"`` left for dense steps that are DeepSpeed's own: the communication dtype).
        max_age: the age bound (0: none).
        warmup_steps / density_warmup_steps: an int, or ``"auto"`` (resolved by the hook from the lr schedule).
        transactional: a skipped step leaves no trace: the residuals and momenta keep working copies
            (:func:`step_transaction`).
        reasons: field name -> short reason.
    """
    stage: int
    sync: str
    compress: str
    layout: str
    exchange: str
    density: float
    values: str
    dense_values: str
    max_age: int
    warmup_steps: Any
    density_warmup_steps: Any
    transactional: bool
    reasons: Mapping[str, str] = field(default_factory=dict)

    def with_layout(self, node: bool, exchange: str) -> "Plan":
        """This plan with the layout the hook's pipeline resolved (``node``: node-aware, else flat), the exchange
        it runs there, and why."""
        layout = "node" if node else "flat"
        why = ("resolved: several nodes of several ranks" if node else
               "resolved: one node, or a group the node-aware exchange does not serve")
        reason = self.reasons.get("layout", "set in the config") if self.layout != "auto" else why
        return dataclasses.replace(self, layout=layout, exchange=exchange, reasons={**self.reasons, "layout": reason})

    def describe(self) -> str:
        """One start-up line: every field, with its reason where it has one."""
        parts = []
        for f in dataclasses.fields(self):
            if f.name == "reasons":
                continue
            value = getattr(self, f.name)
            why = self.reasons.get(f.name)
            parts.append(f"{f.name}={value}" + (f" ({why})" if why else ""))
        return "DRAGONN: plan: " + ", ".join(parts)


def resolve_compress(cfg: Any, facts: Facts) -> Tuple[str, str]:
    """``compress`` resolved for this engine (``auto``: ``momentum`` for an Adam-type optimizer the momentum
    mode serves, with error feedback, a dense warm-up and density < 1; else ``gradient``), and why."""
    if cfg.sync == "local_steps":
        return "gradient", "local steps compress the pseudo-gradient"
    if cfg.compress != "auto":
        return _v(cfg.compress), "set in the config"
    why = facts.momentum_refusal
    unmet = [what for what, ok in (("error feedback is off", cfg.error_feedback),
                                   ("warmup_steps is 0: no dense steps to estimate Adam's variance from",
                                    cfg.warmup_steps != 0),
                                   ("density is 1.0", cfg.density < 1.0)) if not ok]
    if not why and not unmet:
        return "momentum", "an Adam-type optimizer"
    return "gradient", (f"the momentum mode {why}" if why else "; ".join(unmet))


def step_transaction(exact: Optional[bool], may_skip: Optional[bool], loss_scaler: Optional[bool]) -> Tuple[bool, str]:
    """Whether a skipped step must leave no trace (working copies of the residuals and momenta), and why:
    ``advanced.exact_skipped_steps`` where set, else only under the fp16 loss scaler (``feedback.py``)."""
    if not may_skip:
        return False, "no step is skipped: no loss scaler, no overflow check"
    if exact is not None:
        return bool(exact), "advanced.exact_skipped_steps"
    if loss_scaler:
        return True, "the fp16 loss scaler skips steps: they leave no trace"
    return False, "steps skipped on a non-finite gradient return what they sent to the residuals (O(k))"


def compress_lines(cfg: Any, plan: Plan, adam: bool) -> List[str]:
    """The start-up lines of ``compress: auto`` (which mode runs and why, in plain words), and a warning for a
    momentum-mode key with no effect under the mode it chose; none where ``compress`` was set or under local
    steps. ``adam``: the optimizer is Adam-type (the gradient mode then costs quality: docs/tuning.md)."""
    if _v(cfg.compress) != "auto" or _v(cfg.sync) == "local_steps":
        return []
    reason = plan.reasons["compress"]
    if plan.compress == "momentum":
        lines = [f"DRAGONN: compress 'auto' -> 'momentum' ({reason}): each rank's Adam momentum is sparsified, "
                 f"and Adam's variance is frozen from the dense warm-up (refreshed every "
                 f"'advanced.variance_refresh_steps')"]
    elif not adam:
        lines = [f"DRAGONN: compress 'auto' -> 'gradient' ({reason}): the gradient is sparsified, the optimizer "
                 f"unchanged"]
    else:
        lines = [f"DRAGONN: warning: compress 'auto' -> 'gradient' although the optimizer is Adam-type, because "
                 f"{reason}. With Adam the gradient mode costs quality (docs/tuning.md#3-warm-ups); keep the dense "
                 f"warm-up (leave 'warmup_steps' out) to get the momentum mode, or set 'compress': 'gradient' to "
                 f"choose this one"]
    refresh = cfg.given(*MOMENTUM_KEYS)
    if refresh and plan.compress == "gradient":
        lines.append(f"DRAGONN: warning: 'dragonn.{refresh[0]}' has no effect: it applies to the momentum mode, "
                     f"and compress 'auto' chose 'gradient' ({reason})")
    return lines


def density_schedule(cfg: Any) -> Any:
    """The ``schedule.DensitySchedule`` of ``cfg`` (``compress`` resolved): the variance is refreshed only in
    the momentum mode; local steps send each round at ``density`` from the first, with no density warm-up
    (``engine/local_steps.py``); ``warmup_steps`` ``auto`` is decided later by the hook's tracker."""
    from .schedule import UNDECIDED, DensitySchedule  # (this module imports nothing from the package when it loads)
    refresh = cfg.variance_refresh_steps if _v(cfg.compress) == "momentum" else 0
    ramp = 0 if _v(cfg.sync) == "local_steps" else cfg.density_warmup_steps
    warmup = UNDECIDED if cfg.warmup_steps == "auto" else cfg.warmup_steps
    return DensitySchedule(cfg.density, warmup, ramp, cfg.density_warmup_start, refresh)


def layout_choice(mode: str, per_node: Optional[int], world: int, why: str) -> Tuple[Optional[int], str]:
    """``hierarchy`` ``mode`` (``auto`` / ``node``) resolved over a group of ``world`` ranks whose launcher
    reports ``per_node`` ranks per node (None: no consistent layout, for the reason ``why``): (ranks per node,
    or None for flat; the reason).

    Raises:
        ValueError: ``mode`` is ``node`` and the group is not several nodes of several ranks.
    """
    if per_node is not None and (per_node == 1 or per_node == world):
        why = "one rank per node" if per_node == 1 else f"a single node of {world} ranks"
        per_node = None
    if per_node is None and mode == "node":
        hint = "Set 'advanced.ranks_per_node', or use" if "did not export" in why else "Use"
        raise ValueError(f"'dragonn.hierarchy': 'node' needs several nodes of several ranks each: {why}. "
                         f"{hint} 'hierarchy': 'flat' or 'auto'")
    return per_node, why


#: ``values`` ``"auto"``: int4 codes at or below this density (measured: 0.001 and 0.01 per
#: step, 0.1 for local steps' Δ; docs/results.md "Defaults that follow the density")
INT4_MAX_DENSITY = 0.1
#: ``max_age`` ``"auto"``: ``round(AGE_FACTOR / density)`` at or below this density (300 at 0.001), else 0
AGE_MAX_DENSITY = 0.002
AGE_FACTOR = 0.3
#: ``sync: local_steps`` without ``density``: the Δ's density (int4 values: 1/7 of DiLoCo's bytes at its loss)
LOCAL_STEPS_DENSITY = 0.1


def resolve_defaults(cfg: Any, stage: int) -> Tuple[Any, Dict[str, str]]:
    """``cfg`` with the defaults that follow ``density`` and ``sync`` resolved for ZeRO stage ``stage``, and a
    short reason per resolved key. Idempotent (a resolved key is no longer ``"auto"`` / left out):

    - ``density`` left out under ``sync: local_steps``: :data:`LOCAL_STEPS_DENSITY`;
    - ``advanced.values`` ``auto``: ``int4`` at density <= :data:`INT4_MAX_DENSITY`, else ``dtype``;
    - ``advanced.dense_values`` stays ``auto``, DeepSpeed's own dense collective: int4 dense steps (the
      warm-up Adam's variance is frozen from) cost the GPT +3.0 % on one of two seeds (docs/results.md);
    - ``advanced.max_age`` ``auto``: ``round(0.3 / density)`` at density <= :data:`AGE_MAX_DENSITY` with
      ``sync: every_step``, else 0.

    ``density_warmup_steps`` and ``outer_lr`` ``"auto"`` need the engine; they follow ``density`` where they are
    resolved (``schedule.auto_density_warmup_steps``, ``outer.auto_outer_lr``).
    """
    from .schedule import MAX_WAIT, element_wait  # (this module imports nothing from the package when it loads)
    local = _v(cfg.sync) == "local_steps"
    reasons: Dict[str, str] = {}
    updates: Dict[str, Any] = {}
    density = cfg.density
    if local and "density" not in cfg.model_fields_set:
        density = updates["density"] = LOCAL_STEPS_DENSITY
        reasons["density"] = "left out under sync local_steps: the Δ at 0.1"
    small = density <= INT4_MAX_DENSITY
    advanced: Dict[str, Any] = {}
    if _v(cfg.values) == "auto":
        advanced["values"] = "int4" if small else "dtype"
        reasons["values"] = f"density {density} {'<=' if small else '>'} {INT4_MAX_DENSITY}"
    if _v(cfg.dense_values) == "auto":  # int4 dense steps cost the GPT +3.0 % (seed 1234): not a default
        reasons["dense_values"] = "DeepSpeed's own dense collective"
    if cfg.max_age == "auto":
        on = not local and density <= AGE_MAX_DENSITY
        advanced["max_age"] = round(min(AGE_FACTOR / density, MAX_WAIT)) if on else 0  # (bounded: density 1e-300)
        reasons["max_age"] = (f"density {density}" if on else
                              "off: sync local_steps" if local else f"off: density {density} > {AGE_MAX_DENSITY}")
    if cfg.density_warmup_steps == "auto":
        reasons["density_warmup_steps"] = (
            "no effect under sync local_steps" if local else
            f"none: density {density} >= density_warmup_start {cfg.density_warmup_start}"
            if density >= cfg.density_warmup_start else f"max(100, 3 x warmup_steps, {element_wait(density)})")
    if local and density >= 1.0:  # (a value format shapes a selection; a Δ at density 1.0 is not selected)
        reasons["values"] = "not used: the Δ at density 1.0 goes in a dense allreduce"
    if not updates and not advanced:
        return cfg, reasons
    out = cfg.model_copy(deep=True)
    for key, value in updates.items():
        setattr(out, key, value)  # validated (validate_assignment)
    for key, value in advanced.items():
        setattr(out.advanced, key, value)
    return out, reasons


def resolve(cfg: Any, facts: Facts, defaults: Optional[Mapping[str, str]] = None) -> Plan:
    """The plan of an enabled block on an engine that passed the ``start`` and ``engine`` rows; ``defaults``:
    the reasons of :func:`resolve_defaults` (``cfg`` already resolved by it)."""
    compress, compress_why = resolve_compress(cfg, facts)
    reasons: Dict[str, str] = {"compress": compress_why, **(defaults or {})}
    if cfg.warmup_steps == "auto":
        reasons["warmup_steps"] = "twice the learning-rate warm-up, at least 30 (the hook logs the number)"
    if _v(cfg.hierarchy) == "auto":
        reasons["layout"] = "node-aware on several nodes of several ranks, resolved with the group"
    skip, reasons["transactional"] = step_transaction(cfg.exact_skipped_steps, facts.may_skip_steps,
                                                      facts.loss_scaler)
    exchange = "reduce_scatter" if facts.stage in (1, 2, 3) and cfg.sync != "local_steps" else _v(cfg.exchange)
    return Plan(stage=facts.stage, sync=_v(cfg.sync), compress=compress, layout=_v(cfg.hierarchy),
                exchange=exchange, density=cfg.density, values=_v(cfg.values), dense_values=_v(cfg.dense_values),
                max_age=cfg.max_age,
                warmup_steps=cfg.warmup_steps, density_warmup_steps=cfg.density_warmup_steps,
                transactional=skip, reasons=reasons)


__all__ = ["DragonnUnsupportedError", "Facts", "compress_lines", "density_schedule", "layout_choice", "LOCAL_STEPS_KEYS", "MOMENTUM_KEYS", "PHASES", "Plan", "RULES",
           "Rule", "check", "flag", "node_unsupported", "refusal", "resolve", "resolve_compress", "resolve_defaults",
           "step_transaction", "zero_stage"]
