"""Data files tokenized once into a cache that every later job, rank and requeue reuses
(`prepare.py`, chat records `prepare_chat.py`), with the lock that makes concurrent jobs wait for
the one doing the work (`lock.py`), its worker processes (`ordered_pool.py`) and its
progress (`progress.py`)."""
