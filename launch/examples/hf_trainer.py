"""Hugging Face Trainer with DRAGONN: one config block plus ``ds_dragonn.enable()``.

    . launch/setup_env.sh
    deepspeed --num_gpus 2 --master_addr 127.0.0.1 launch/examples/hf_trainer.py

A tiny GPT-2 built from a config (nothing is downloaded) learns the bytes of this interpreter's ``os.py``.
"""
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ds_dragonn

ds_dragonn.enable()  # without it DeepSpeed silently ignores the "dragonn" block

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "dragonn": {"enabled": True, "density": 0.01, "min_compress_numel": 1, "warmup_steps": 5, "log_interval": 20},
}


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n=512, length=64):
        raw = open(os.__file__, "rb").read()[: n * length]
        self.x = torch.tensor(list(raw), dtype=torch.long).view(-1, length)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


if __name__ == "__main__":
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir="runs/examples/hf_trainer", max_steps=60, per_device_train_batch_size=4,
                             learning_rate=1e-3, deepspeed=DS_CONFIG, use_cpu=not torch.cuda.is_available(),
                             report_to=[], logging_steps=20, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Bytes())
    print(f"process {args.process_index} of {args.world_size}", flush=True)
    trainer.train()
    hook = trainer.model_wrapped.dragonn
    if args.process_index == 0:
        print(f"compressed reductions: {hook.telemetry.compressed_reductions}, "
              f"bytes ratio vs dense: {hook.telemetry.bytes_ratio:.3f}")
    sys.exit(0)
