"""Multi-rank ZeRO stage 1/2 cases, for ``tests/test_zero.py``; executed inside each rank by
``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import init_distributed, train_mlp, zero_config

ZERO_RUNS = {f"s{stage}_{prec}_{name}": zero_config(stage, d, bf16=prec == "bf16")
             for stage in (1, 2) for prec in ("fp32", "bf16")
             for name, d in (("dense", None), ("d1", {"enabled": True, "density": 1.0}),
                             ("d001", {"enabled": True, "density": 0.01}))}
ZERO_RUNS.update({
    "s2_fp32_gas2_dense": zero_config(2, None, gas=2),
    "s2_fp32_gas2_d1": zero_config(2, {"enabled": True, "density": 1.0}, gas=2),
    "s2_fp32_gas2_d001": zero_config(2, {"enabled": True, "density": 0.01}, gas=2),
    "s2_fp32_warmup": zero_config(2, {"enabled": True, "density": 0.01, "warmup_steps": 2}),
    "s2_fp32_overlap_dense": zero_config(2, None, overlap_comm=True),
    "s2_fp32_overlap_d1": zero_config(2, {"enabled": True, "density": 1.0}, overlap_comm=True),
    "s1_fp32_no_multi_rank_dense": zero_config(1, None, use_multi_rank_bucket_allreduce=False),
    "s1_fp32_no_multi_rank_d1": zero_config(1, {"enabled": True, "density": 1.0},
                                             use_multi_rank_bucket_allreduce=False),
})
for _name, _d in (("dense", None), ("d1", {"enabled": True, "density": 1.0})):
    # bf16 parameters with fp32 gradient accumulation: ZeRO keeps a compact fp32 gradient partition
    ZERO_RUNS[f"s2_bf16_accfp32_{_name}"] = {**zero_config(2, _d, bf16=True), "data_types": {"grad_accum_dtype": "fp32"}}
    # fp32 gradients reduced in bf16; error feedback off, else the residual would (rightly) carry the bf16
    # rounding of every value into the next step, which the dense path drops
    _d = None if _d is None else {**_d, "advanced": {"error_feedback": False}}
    ZERO_RUNS[f"s2_fp32_commbf16_{_name}"] = {**zero_config(2, _d), "communication_data_type": "bf16"}
ZERO_REFUSED = {
    "stage3_offload": zero_config(3, {"enabled": True}, offload_param={"device": "cpu"}),
    "no_reduce_scatter": zero_config(2, {"enabled": True}, reduce_scatter=False),
    "offload": zero_config(2, {"enabled": True}, offload_optimizer={"device": "cpu"}),
    "not_contiguous": zero_config(2, {"enabled": True}, contiguous_gradients=False),
}
ZERO_STEPS = 4
ZERO_LAYERS = (64, 256, 10)  # 19,210 parameters: several IPG buckets of 6000 elements


def zero_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn

    out = {}
    for name, cfg in ZERO_RUNS.items():
        engine, hook = train_mlp(cfg, rank, ZERO_LAYERS, ZERO_STEPS * cfg["gradient_accumulation_steps"])
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "telemetry": hook.telemetry.summary() if hook else None,
                     "hooked": hook is not None and engine.optimizer.average_tensor == hook.average_tensor}
    for name, cfg in ZERO_REFUSED.items():
        model = torch.nn.Linear(4, 4)
        try:
            ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = None
        except ds_dragonn.DragonnUnsupportedError as err:
            out[name] = str(err)
    torch.save(out, Path(out_dir) / f"zero_rank{rank}.pt")
    torch.distributed.destroy_process_group()
