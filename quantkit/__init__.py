"""quantkit: streaming INT4 quantization and checkpoint conversion for giant MoE language models."""

__version__ = "0.1.0"
