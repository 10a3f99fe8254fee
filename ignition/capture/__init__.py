"""GPU capture: fixed-address arena, compile + CUDA graph capture, raw graph walk, recording.

Runs on the GPU machine only (torch with CUDA, Triton, nvcc). `python -m ignition.capture --help`.
"""
