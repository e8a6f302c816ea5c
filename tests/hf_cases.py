"""Rank functions for tests/test_frameworks.py: Hugging Face ``Trainer`` (transformers + accelerate) with a
``"dragonn"`` block in its DeepSpeed config, activated by ``ds_dragonn.enable()``.

A tiny GPT-2 built from a config (nothing is downloaded) learns the bytes of the standard library's
``os.py``; dropout is off so that runs differ only by their gradient reduction."""
from __future__ import annotations

import os
from pathlib import Path

import torch

STEPS = 4
_DRAGONN = {"enabled": True, "min_compress_numel": 1, "policy": "always", "warmup_steps": 0,
            "density_warmup_steps": 0}
RUNS = {f"s{stage}_{name}": (stage, block) for stage in (0, 2)
        for name, block in (("dense", None), ("d1", {**_DRAGONN, "density": 1.0}),
                            ("d001", {**_DRAGONN, "density": 0.01}))}


class StdlibBytes(torch.utils.data.Dataset):
    """(n, L) windows of ``os.py``'s bytes as causal-LM examples (labels = inputs; the model shifts)."""

    def __init__(self, n: int = 128, length: int = 32):
        data = torch.tensor(list(Path(os.__file__).read_bytes()[: n * length]), dtype=torch.long)
        self.x = data.view(n, length)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def ds_config(stage: int, block: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if block is not None:
        cfg["dragonn"] = dict(block)
    return cfg


def train(cfg: dict, out: str, max_steps: int = STEPS, save_steps: int | None = None, resume: str | None = None,
          lr_warmup: int = 0):
    """One ``Trainer`` run (``lr_warmup``: Hugging Face's constant schedule with that many warm-up steps);
    returns (trainer, final parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
                             deepspeed=cfg, use_cpu=True, report_to=[], logging_steps=10**6, seed=0,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 10**6,
                             dataloader_num_workers=0, disable_tqdm=True, warmup_steps=lr_warmup,
                             lr_scheduler_type="constant_with_warmup" if lr_warmup else "linear")
    trainer = Trainer(model=model, args=args, train_dataset=StdlibBytes())
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [p.detach().float().clone() for p in trainer.model_wrapped.module.parameters()]


def trainer_runs(rank: int, world: int, out_dir: str) -> None:
    import ds_dragonn
    ds_dragonn.enable()
    out = {}
    for name, (stage, block) in RUNS.items():
        trainer, params = train(ds_config(stage, block), str(Path(out_dir) / name))
        hook = getattr(trainer.model_wrapped, "dragonn", None)
        out[name] = {"params": params, "compressed": None if hook is None else hook.telemetry.compressed_reductions,
                     "engine": type(trainer.model_wrapped).__name__}
    # Trainer's own checkpointing (save_steps, resume_from_checkpoint) carries the residuals
    cfg = ds_config(0, {**_DRAGONN, "density": 0.01})
    ckpt = Path(out_dir) / "resume"
    _, whole = train(cfg, str(ckpt), save_steps=STEPS // 2)
    tags = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.glob("checkpoint-*/*/dragonn_rank*.pt"))
    trainer, resumed = train(cfg, str(ckpt), resume=str(ckpt / f"checkpoint-{STEPS // 2}"))
    hook = trainer.model_wrapped.dragonn
    out["resume"] = {"whole": whole, "resumed": resumed, "state_files": tags, "notes": list(hook.notes)}
    # the default "warmup_steps": "auto" follows the learning rate of Trainer's own schedule (not in DeepSpeed)
    auto = {k: v for k, v in _DRAGONN.items() if k != "warmup_steps"}
    trainer, _ = train(ds_config(0, {**auto, "density": 0.01}), str(Path(out_dir) / "auto"), max_steps=45,
                       lr_warmup=20)
    hook = trainer.model_wrapped.dragonn
    out["auto_warmup"] = (hook.schedule.warmup_steps, hook.telemetry.compressed_reductions > 0)
    torch.save(out, Path(out_dir) / f"trainer_rank{rank}.pt")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def accelerate_runs(rank: int, world: int, out_dir: str) -> None:
    """An Accelerate training loop with ``DeepSpeedPlugin(hf_ds_config=...)`` (``accelerate launch
    --use_deepspeed`` sets ``ACCELERATE_USE_DEEPSPEED=true``, as the test does), each run of :data:`RUNS`."""
    import ds_dragonn
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    ds_dragonn.enable()
    out = {}
    for name, (stage, block) in RUNS.items():
        AcceleratorState._reset_state(True)  # one Accelerator per run, as one per script
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage, block)))
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g))
        model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
        for step, (x, y) in enumerate(loader):
            acc.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            if step + 1 == STEPS:
                break
        hook = getattr(model, "dragonn", None)
        out[name] = {"params": [p.detach().float().clone() for p in model.module.parameters()],
                     "compressed": None if hook is None else hook.telemetry.compressed_reductions,
                     "engine": type(model).__name__, "accelerate_processes": acc.num_processes,
                     "deepspeed_world": model.dp_world_size}
    torch.save(out, Path(out_dir) / f"accelerate_rank{rank}.pt")
