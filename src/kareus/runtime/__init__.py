"""Running partitions and plans on real hardware with PyTorch (an optional extra)."""
