"""Weighted sources read as one stream (data.mix): the mixture (`mix.py`), its positions merged
for another world size (`merge.py`) and a cached source it draws from (`cached.py`)."""
