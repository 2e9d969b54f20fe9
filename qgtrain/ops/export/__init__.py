"""`qgtrain export`, one module per step: pipeline.py runs it (origin: the checkpoint it reads;
target: the folder it writes; rebuild, safetensors_io, writer, reload), adapter.py and merging.py
export a LoRA run, ema.py reads the averaged weights instead."""
