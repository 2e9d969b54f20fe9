"""A user's data files: found from globs (`sources.py`), reached and opened safely
(`opening.py`), read by column (`columns.py`) and cut into shards a stream reads from any point
(`shards.py`)."""
