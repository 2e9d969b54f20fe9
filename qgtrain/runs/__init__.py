"""A run as its directory records it: where the directory is and who may write it (`rundir.py`,
`access.py`), one start's claim on it (`claim.py`) and the run's life (`lifecycle.py`). The
checkpoints inside it are `state/`'s."""
