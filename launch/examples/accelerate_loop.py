"""An Accelerate training loop with DRAGONN: ``DeepSpeedPlugin`` with a "dragonn" block, ``ds_dragonn.enable()``.

    . launch/setup_env.sh
    accelerate launch --use_deepspeed --num_processes 2 --num_machines 1 --mixed_precision no \
        --main_process_ip 127.0.0.1 --main_process_port 29500 launch/examples/accelerate_loop.py

The model learns the real UCI digits bundled with scikit-learn. On a CPU machine accelerate 1.x counts each
rank as a world of one (``process 0 of 1``: the loader is not sharded), while DeepSpeed's gradient reduction,
compressed here, spans both ranks; on GPUs it shards as usual.
"""
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from sklearn.datasets import load_digits

import ds_dragonn

ds_dragonn.enable()  # without it DeepSpeed silently ignores the "dragonn" block

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
    "dragonn": {"enabled": True, "density": 0.01, "min_compress_numel": 1, "warmup_steps": 10},
}

if __name__ == "__main__":
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG))
    digits = load_digits()
    data = torch.utils.data.TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0,
                                          torch.tensor(digits.target))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    print(f"process {acc.process_index} of {acc.num_processes}, {len(loader)} batches", flush=True)
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        acc.print(f"epoch {epoch}: loss {loss.item():.3f}")
    acc.print(f"compressed reductions: {model.dragonn.telemetry.compressed_reductions}, "
              f"bytes ratio vs dense: {model.dragonn.telemetry.bytes_ratio:.3f}")
