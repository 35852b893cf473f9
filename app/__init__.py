"""DCP Studio: convert, inspect and load PyTorch checkpoints (DCP, torch.save, safetensors)."""

__version__ = "0.1.0"
