"""Training: the GRPO LightningModule, its optimizer, log-probs, packing, checkpoints and distributed helpers."""
