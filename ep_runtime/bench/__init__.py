"""Measuring EP layers: phase timing with warm-up, bytes and FLOPs, same-run baselines, reports.

Conventions (say them in every report): bandwidth counts bytes **received** by a rank, its own
tokens included (DeepEP's definition), from valid rows only; phase time is the max over ranks
after a barrier; expert TFLOP/s counts valid (token, expert) pairs only.
"""
