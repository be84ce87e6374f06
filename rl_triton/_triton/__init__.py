"""Triton kernels: one scan machinery (scan.py), coefficient builders, launcher and ops."""
