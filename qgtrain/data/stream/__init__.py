"""Training data read as a stream, never cached: batches from a task's IterableDataset resumed
exactly (`streams.py`, `kinds.py`), data files streamed (`filestream.py`, `chat_stream.py`,
their plan `plan.py` and held-out splits `heldout.py`), the seam every source hands samples
through (`readers.py`) and rank 0's dispatch of a stream that cannot be split (`dispatch.py`)."""
