"""Downstream tasks (eval.tasks): their items, how a causal LM scores them, and the scorer the loop
and `qgtrain eval` share."""
