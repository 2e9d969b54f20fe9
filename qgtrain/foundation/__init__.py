"""What every layer reads and nothing here imports back: the one error type and its exit codes, the
Task contract, the trust rules for code and files, durations, atomic files. None of it imports
torch, so a login node loads it at once."""
