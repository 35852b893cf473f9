"""DCP Studio formats: torch.save, DCP, detection."""
