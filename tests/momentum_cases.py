"""Multi-rank cases of the momentum mode (``"compress": "momentum"``), for ``tests/test_momentum.py``; executed
inside each rank by ``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed, train_mlp, zero_config

#: pipeline cases: (exchange, numel, density); float64 buckets, 2 micro steps per step
PIPE_CASES = [("allgather", 1000, 0.05), ("partitioned", 1001, 0.05), ("allgather", 7, 0.5), ("allgather", 0, 0.1)]
PIPE_STEPS = 6
BETA = 0.9
def pipe_input(case: int, rank: int, step: int, micro: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * case + 100 * step + 10 * micro + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64) * (1.0 + step)


_M = {"enabled": True, "density": 0.05, "compress": "momentum", "warmup_steps": 2}
#: engine runs: ZeRO 0, 1, 2 in bf16 with accumulation 2 and clipping, and fp32 at density 1.0, where the
#: momentum mode must move the model as DeepSpeed's dense engine does with Adam's variance frozen after the
#: warm-up (``frozen_reference``: the dense engine plus the same VarianceFreeze, armed by hand)
ENGINE_RUNS = {f"s{s}_bf16_gas2_clip": {**zero_config(s, _M, bf16=True, gas=2), "gradient_clipping": 1.0}
               for s in (0, 1, 2)}
# no clipping here (DeepSpeed's default clips at 1.0): it would clip the momentum here, the gradient there
# a learning rate that changes every step: density 1.0 must still be the dense engine's update
_SCHEDULE = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                               "warmup_num_steps": 3, "total_num_steps": 8}}}
ENGINE_RUNS["s0_fp32_d1"] = {**zero_config(0, {**_M, "density": 1.0}), "gradient_clipping": 0.0,
                             **_SCHEDULE}
ENGINE_RUNS["s2_fp32_d1"] = {**zero_config(2, {**_M, "density": 1.0}), "gradient_clipping": 0.0,
                             **_SCHEDULE}
ENGINE_STEPS = 6
_R = {**_M, "advanced": {"variance_refresh_steps": 2}}
_NO_DECAY = {"optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "weight_decay": 0.0}}}
#: variance refresh every 2 steps after the warm-up of 2 (steps 3 and 5): the last step is a refresh step, and
#: without weight decay (DeepSpeed's torch AdamW decays by 0.01 by default) it must not move the weights
REFRESH_RUNS = {"s0_bf16_gas2_clip_refresh": {**zero_config(0, _R, bf16=True, gas=2), "gradient_clipping": 1.0,
                                              **_NO_DECAY},
                "s1_fp32_refresh": {**zero_config(1, _R), **_NO_DECAY},
                "s2_fp32_refresh": {**zero_config(2, _R), **_NO_DECAY}}
LAYERS = (32, 64, 10)


class FrozenAdamReference:
    """Dense Adam with its bias-corrected variance held at its value before the first step after ``arm()``
    (1-bit Adam's freeze applied to the gradient): before each later step ``v`` is set so that Adam's own
    ``β2·v + (1 − β2)·g²`` lands on ``V̂·(1 − β2^(t+1))``. An independent reference for the momentum mode at
    density 1.0, where the averaged momentum is the dense gradient's momentum."""

    def __init__(self, engine, freeze_step: int):
        from ds_dragonn.engine.adam import base_optimizer
        self.engine, self.freeze_step, self.armed, self.frozen = engine, freeze_step, False, None
        base_optimizer(engine).register_step_pre_hook(self._before)

    def arm(self):
        self.armed = True

    def _before(self, opt, args, kwargs):
        if not self.armed or int(self.engine.global_steps) < self.freeze_step:
            return
        for group in opt.param_groups:
            b2 = group["betas"][1]
            for p in group["params"]:
                st = opt.state[p]
                t = float(st["step"])
                if self.frozen is None or id(p) not in self.frozen:
                    self.frozen = self.frozen or {}
                    self.frozen[id(p)] = st["exp_avg_sq"] / (1 - b2 ** t)
                c2 = 1 - b2 ** (t + 1)
                st["exp_avg_sq"].copy_((self.frozen[id(p)] * c2 - (1 - b2) * p.grad * p.grad) / b2)


def frozen_reference(rank: int) -> list:
    """DeepSpeed's dense ZeRO-0 Adam engine, its variance frozen after ``_M['warmup_steps']`` steps."""
    engine, _ = train_mlp({**zero_config(0, None), "gradient_clipping": 0.0, **_SCHEDULE}, rank, LAYERS, 0)
    freeze = FrozenAdamReference(engine, _M["warmup_steps"])
    g = torch.Generator().manual_seed(rank)  # train_mlp's sample stream
    for step in range(ENGINE_STEPS):
        if step == _M["warmup_steps"]:
            freeze.arm()
        x = torch.randn(8, LAYERS[0], generator=g)
        y = torch.randint(0, LAYERS[2], (8,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
    return [p.detach().float().clone() for p in engine.module.parameters()]


def pipeline_runs(rank: int, world: int, out_dir: str) -> None:
    """The pipeline with a local momentum, float64: every step's decoded output, and at the end every residual
    (worker and, partitioned, server)."""
    init_distributed()
    from ds_dragonn.comm.torch_backend import TorchCommBackend
    from ds_dragonn.compress import DragonnCompressor
    from ds_dragonn.exchange import AllgatherExchange, PartitionedExchange
    from ds_dragonn.feedback import ErrorFeedback
    from ds_dragonn.momentum import LocalMomentum
    from ds_dragonn.pipeline import CompressedAllreduce

    backend = TorchCommBackend()
    out = []
    for c, (exchange, numel, density) in enumerate(PIPE_CASES):
        comp = DragonnCompressor(density, min_sample=64)
        ex = (PartitionedExchange(backend, DragonnCompressor(density, min_sample=64)) if exchange == "partitioned"
              else AllgatherExchange(backend))
        ef, mom = ErrorFeedback(True), LocalMomentum(BETA)
        pipe = CompressedAllreduce(comp, backend, ef, ex, target=mom)
        applied = []
        for step in range(PIPE_STEPS):
            for micro in range(2):  # ZeRO-2 style: a reduction per micro step, decoded sums add up
                o, _ = pipe.reduce([pipe_input(c, rank, step, micro, numel)], "b", seed=7 * step + micro,
                                   postscale=1.0 / world)
                applied.append(o.clone())
            mom.end_step(True)
            ef.end_step(True)
        server = getattr(ex, "server", None)
        out.append({"applied": applied, "residual": ef.residuals.get("b", torch.zeros(numel, dtype=torch.float64)).clone(),
                    "server": None if server is None or "b" not in server.residuals else server.residuals["b"].clone(),
                    "momentum": mom.momenta.get("b", torch.zeros(numel, dtype=torch.float64)).clone()})
    torch.save(out, Path(out_dir) / f"mompipe_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn
    from ds_dragonn.engine import variance_math
    out = {}
    for name, cfg in ENGINE_RUNS.items():
        # density 1.0 against an unfloored reference: no floor (ZeRO 2 floors over the rank's flat partition)
        variance_math.VARIANCE_FLOOR = 0.0 if name.endswith("_d1") else 0.01
        engine, hook = train_mlp(cfg, rank, LAYERS, ENGINE_STEPS * cfg["gradient_accumulation_steps"])
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "compressed": hook.telemetry.compressed_reductions if hook else 0,
                     "frozen": hook is not None and hook.variance_freeze is not None
                     and hook.variance_freeze.frozen is not None,
                     "momenta": len(hook.momentum.momenta) if hook and hook.momentum is not None else 0}
    for name, cfg in REFRESH_RUNS.items():  # params before and after the last step (a refresh step)
        gas = cfg["gradient_accumulation_steps"]
        engine, hook = train_mlp(cfg, rank, LAYERS, (ENGINE_STEPS - 1) * gas)
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        dtype = next(engine.module.parameters()).dtype
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(gas):
            x = torch.randn(8, LAYERS[0], generator=g).to(dtype)
            y = torch.randint(0, LAYERS[2], (8,), generator=g)
            engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
            engine.step()
        out[name] = {"before": before, "params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "refreshed": hook.variance_freeze.refreshed, "compressed": hook.telemetry.compressed_reductions,
                     "dense": hook.telemetry.dense_reductions,
                     "residual": sum(float(r.double().abs().sum()) for r in hook.error_feedback.residuals.values())}
    out["frozen_reference"] = frozen_reference(rank)
    # an optimizer without betas is refused, naming it
    model = torch.nn.Linear(4, 4)
    cfg = {**zero_config(0, _M), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["sgd_error"] = None
    except ds_dragonn.DragonnUnsupportedError as err:
        out["sgd_error"] = str(err)
    torch.save(out, Path(out_dir) / f"momengine_rank{rank}.pt")
    torch.distributed.destroy_process_group()
