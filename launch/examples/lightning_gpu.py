"""Lightning's DeepSpeedStrategy with DRAGONN: a "dragonn" block plus ``ds_dragonn.enable()``. CUDA only:
Lightning's DeepSpeedStrategy refuses CPU machines ("The DeepSpeed strategy is only supported on CUDA GPUs").

    . launch/setup_env.sh
    python launch/examples/lightning_gpu.py      # Lightning starts one process per GPU itself
"""
import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from sklearn.datasets import load_digits

import ds_dragonn

ds_dragonn.enable()  # without it DeepSpeed silently ignores the "dragonn" block

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2},
    "dragonn": {"enabled": True, "density": 0.01, "min_compress_numel": 1, "warmup_steps": 10},
}


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    digits = load_digits()
    data = torch.utils.data.TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0,
                                          torch.tensor(digits.target))
    trainer = L.Trainer(accelerator="gpu", devices=-1, strategy=DeepSpeedStrategy(config=DS_CONFIG), max_epochs=3)
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    if trainer.is_global_zero:
        print(f"compressed reductions: {trainer.strategy.model.dragonn.telemetry.compressed_reductions}")
