"""How the ranks hold the model: the strategy (strategy.py), a step on the model it set up
(step.py: backward, clip, update) and what each strategy applies: replicas under DDP
(replicas.py), FSDP2 shards (sharding.py) sent from rank 0's one build (initial_shards.py), and
torch.compile before either (compiling.py). A new strategy is a class in strategy.py and the module
that wraps for it here."""
