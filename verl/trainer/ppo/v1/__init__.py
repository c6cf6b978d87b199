"""verl 0.9.1's `verl.trainer.ppo.v1` package: here only its `utils` helpers (the per-session advantage of
multi-trajectory agent loops); the v1 trainers built on TransferQueue are not part of this package.
"""
