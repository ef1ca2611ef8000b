"""Quantized base weights: checkpoint formats, on-the-fly quantization and the kernels."""
