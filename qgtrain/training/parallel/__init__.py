"""How the ranks hold the model: the strategy (strategy.py), a step on the model it set up
(step.py: backward, clip, update) and what it applies for a layout: replicas under DDP
(replicas.py), FSDP2 shards (sharding.py) sent from rank 0's one build (initial_shards.py), and
torch.compile before either (compiling.py). A new layout is a class in strategy.py and the module
that wraps for it here."""
