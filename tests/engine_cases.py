"""Multi-rank ZeRO stage 0 engine cases, for ``tests/test_engine.py``; executed inside each rank by
``tests.multiproc.run_ranks``."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engines import constants_set, engine_config, init_distributed, train_mlp

ENGINE_RUNS = {
    "dense": engine_config(None),
    "dragonn_d1": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}),
    "dragonn_d1_partitioned": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1,
                                              "exchange": "partitioned"}),
    "dragonn_d001_partitioned": engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                                "exchange": "partitioned"}),
    "dragonn_d1_predivide": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}, predivide=2.0),
    "dense_predivide": engine_config(None, predivide=2.0),
    "dragonn_d001": engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1}),
    "dragonn_warmup": engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                      "warmup_steps": 3}),
    "dragonn_disabled": engine_config({"enabled": False, "density": 0.01}),
    "dense_bf16": engine_config(None, bf16=True),
    # auto policy: 1 dense probe, 1 compressed probe, then a decision the ranks agree on (timing-dependent)
    # DeepSpeed's csv monitor (output_path set per run below); warm-up marks the switch
    "dragonn_monitor": {**engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1,
                                          "warmup_steps": 2}),
                        "csv_monitor": {"enabled": True, "job_name": "mon"}},
    "dragonn_auto": engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1, "policy": "auto"}),
    "dragonn_bf16": engine_config({"enabled": True, "density": 0.05, "min_compress_numel": 1}, bf16=True),
    # bf16 pairs cost 6 bytes against 2 dense: at density 1.0 the auto policy sends the bucket dense,
    # "always" compresses it anyway (bounded bytes)
    "dragonn_bf16_d1_auto": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1,
                                            "policy": "auto"}, bf16=True),
    "dragonn_bf16_d1_always": engine_config({"enabled": True, "density": 1.0, "min_compress_numel": 1}, bf16=True),
}
ENGINE_STEPS = 5
#: the auto run probes once and re-checks every 2 steps (the product's 3 and 1000 would not decide in 5 steps)
AUTO_CONSTANTS = {"dragonn_auto": {"AUTO_PROBE_STEPS": 1, "AUTO_RECHECK_INTERVAL": 2}}


def engine_runs(rank: int, world: int, out_dir: str) -> None:
    init_distributed()
    import ds_dragonn

    out = {}
    for name, cfg in ENGINE_RUNS.items():
        if "csv_monitor" in cfg:
            cfg = {**cfg, "csv_monitor": {**cfg["csv_monitor"], "output_path": str(Path(out_dir) / "csv")}}
        with constants_set(**AUTO_CONSTANTS.get(name, {})):
            engine, hook = train_mlp(cfg, rank, (32, 64, 4), ENGINE_STEPS)
        out[name] = {"params": [p.detach().float().clone() for p in engine.module.parameters()],
                     "telemetry": hook.telemetry.summary() if hook else None,
                     "hooked": hook is not None and engine.allreduce_bucket == hook.allreduce_bucket}
    # frozen layers that take turns: b's true gradient is 0, a's residual must never reach b
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(10, 10, bias=False), "b": torch.nn.Linear(10, 10, bias=False)})
    cfg = engine_config({"enabled": True, "density": 0.1, "min_compress_numel": 1})
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}  # steps advance, weights stay
    engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    b_grads = []
    for step in range(6):
        train_a = step % 2 == 0
        model["a"].weight.requires_grad_(train_a)
        model["b"].weight.requires_grad_(not train_a)
        x = torch.ones(4, 10)
        loss = engine.module["a"](x).sum() * 100 + engine.module["b"](x).sum() * 0
        engine.backward(loss)
        if not train_a:
            b_grads.append(float(model["b"].weight.grad.abs().max()))
        engine.step()
    out["frozen_b_grads"] = b_grads
    # the pipeline engine is refused at initialize
    from deepspeed.pipe import PipelineModule
    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1)
    try:
        ds_dragonn.initialize(model=pipe, model_parameters=pipe.parameters(),
                              config=engine_config({"enabled": True}))
        out["pipeline_error"] = None
    except ds_dragonn.DragonnUnsupportedError as err:
        out["pipeline_error"] = str(err)
    out["auto_warmup"] = _auto_warmup_runs(rank)
    torch.save(out, Path(out_dir) / f"engine_rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _auto_warmup_runs(rank: int) -> dict:
    """``"warmup_steps": "auto"`` (the default) through ``ds_dragonn.initialize``, 45 steps each: DeepSpeed's
    WarmupDecayLR from the config (50 warm-up steps), a client LambdaLR rising for 20 steps handed to DeepSpeed,
    the same LambdaLR stepped by the training loop outside DeepSpeed (as Hugging Face's Trainer does with its
    own optimizer), and no scheduler. Per run: the hook's warm-up setting, its schedule's end, the telemetry."""
    import ds_dragonn
    rising = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, t / 20))  # noqa: E731
    runs = {}
    for name, scheduler, client in (
            ("WarmupDecayLR", {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 50, "total_num_steps": 500,
                                                                    "warmup_max_lr": 0.05}}, None),
            ("LambdaLR", None, rising), ("outside", None, None), ("none", None, None)):
        cfg = engine_config({"enabled": True, "density": 0.01, "min_compress_numel": 1})
        del cfg["dragonn"]["warmup_steps"]  # the default
        if scheduler:
            cfg["scheduler"] = scheduler
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 4)
        engine, *_ = ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           lr_scheduler=client)
        outside = rising(engine.optimizer) if name == "outside" else None
        g = torch.Generator().manual_seed(rank)
        for _ in range(45):
            engine.backward(engine(torch.randn(8, 32, generator=g)).square().mean())
            engine.step()
            if outside is not None:
                outside.step()
        hook = engine.dragonn
        runs[name] = {"warmup_steps": hook.cfg.warmup_steps, "schedule": hook.schedule.warmup_steps,
                      "telemetry": hook.telemetry.summary()}
    return runs
