"""A graph classifier in plain torch, trained by qgtrain: which random-graph model made each graph?

    qgtrain train --config config.yaml --config jobs/graph.yaml

The three generators (Erdos-Renyi, Watts-Strogatz small worlds, Barabasi-Albert preferential
attachment) are given the same number of nodes and about the same number of edges, so the average
degree gives nothing away: the model must see structure (hubs, clustering). Graphs have 12 to 40
nodes, so batches are packed: one node list for the whole batch and an index saying which graph each
node belongs to, with messages summed by `index_add_` (what PyTorch Geometric does for you).

Everything here is the user's side of the contract: a dataset, a collate, a model, a loss and
metrics. qgtrain brings the rest: sharding, DDP, checkpoints and exact resume, agreed stops, early
stopping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import qgtrain

GENERATORS = ("erdos_renyi", "watts_strogatz", "barabasi_albert")


class RandomGraphs(Dataset):
    """Graph i is made from its own seed, so any sample can be read at any time, by any rank or
    worker."""

    def __init__(
        self, size: int, seed: int, min_nodes: int = 12, max_nodes: int = 40, degree: int = 4
    ) -> None:
        self.size, self.seed = size, seed
        self.min_nodes, self.max_nodes, self.degree = min_nodes, max_nodes, degree

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % len(GENERATORS)
        nodes = int(torch.randint(self.min_nodes, self.max_nodes + 1, (1,), generator=gen))
        edges = _MAKERS[label](nodes, self.degree, gen)
        return {"edges": edges, "nodes": torch.tensor(nodes), "label": torch.tensor(label)}


def _erdos_renyi(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    pairs = torch.combinations(torch.arange(n), 2)
    keep = torch.rand(len(pairs), generator=gen) < k / (n - 1)
    return pairs[keep].T


def _watts_strogatz(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    src = torch.arange(n).repeat_interleave(k // 2)
    dst = (src + torch.arange(1, k // 2 + 1).repeat(n)) % n
    rewire = torch.rand(len(dst), generator=gen) < 0.1
    dst = torch.where(rewire, torch.randint(0, n, dst.shape, generator=gen), dst)
    keep = src != dst
    return torch.stack([src[keep], dst[keep]])


def _barabasi_albert(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    m = k // 2
    targets, ends = list(range(m)), []
    for node in range(m, n):
        for target in set(targets):
            ends.append((node, target))
        picks = torch.randint(0, len(ends) * 2, (m,), generator=gen).tolist()
        targets = [ends[p // 2][p % 2] for p in picks]  # a node's chance grows with its degree
    return torch.tensor(ends).T


_MAKERS = (_erdos_renyi, _watts_strogatz, _barabasi_albert)


@dataclass
class GraphBatch:
    """Graphs packed into one: edges index the packed node list, `graph` says whose each node is."""

    edges: torch.Tensor  # (2, E), both directions
    degree: torch.Tensor  # (N,)
    graph: torch.Tensor  # (N,)
    labels: torch.Tensor  # (B,)
    graphs: int


def pack(samples: list[dict[str, torch.Tensor]]) -> GraphBatch:
    sizes = torch.stack([s["nodes"] for s in samples])
    offsets = torch.cumsum(sizes, 0) - sizes
    edges = torch.cat([s["edges"] + offset for s, offset in zip(samples, offsets)], dim=1)
    edges = torch.cat([edges, edges.flip(0)], dim=1)  # undirected: a message each way
    total = int(sizes.sum())
    degree = torch.zeros(total, dtype=torch.long).index_add_(
        0, edges[0], torch.ones(edges.shape[1], dtype=torch.long)
    )
    return GraphBatch(
        edges,
        degree,
        torch.arange(len(samples)).repeat_interleave(sizes),
        torch.stack([s["label"] for s in samples]),
        len(samples),
    )


class GraphClassifier(nn.Module):
    """Message passing: each node averages its neighbours' states into its own through an MLP, for a
    few rounds; then the mean over each graph's nodes is classified."""

    def __init__(
        self,
        hidden: int = 64,
        layers: int = 3,
        classes: int = len(GENERATORS),
        max_degree: int = 32,
    ):
        super().__init__()
        self.max_degree = max_degree
        self.embed = nn.Embedding(max_degree + 1, hidden)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.LayerNorm(hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, batch: GraphBatch) -> torch.Tensor:
        h = self.embed(batch.degree.clamp(max=self.max_degree))
        src, dst = batch.edges
        for layer in self.layers:
            messages = torch.zeros_like(h).index_add_(0, dst, h[src])
            h = h + layer(torch.cat([h, messages / batch.degree.clamp(min=1).unsqueeze(1)], dim=1))
        counts = torch.zeros(batch.graphs, device=h.device).index_add_(
            0, batch.graph, torch.ones_like(h[:, 0])
        )
        pooled = torch.zeros(batch.graphs, h.shape[1], device=h.device).index_add_(
            0, batch.graph, h
        )
        return self.head(pooled / counts[:, None])


def loss(model: nn.Module, batch: GraphBatch) -> torch.Tensor:
    return F.cross_entropy(model(batch), batch.labels)


def metrics(model: nn.Module, batch: GraphBatch) -> dict[str, tuple[torch.Tensor, int]]:
    """Sums and counts: qgtrain adds them up over every rank before dividing."""
    correct = (model(batch).argmax(dim=1) == batch.labels).sum()
    return {"accuracy": (correct, batch.graphs)}


def graph_classifier(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Options (task.options): graphs (training set size), hidden, layers."""
    options = {"graphs": 3000, "hidden": 64, "layers": 3, **cfg.task.options}
    seed = cfg.train.seed
    return qgtrain.Task(
        model=GraphClassifier(options["hidden"], options["layers"]),
        train=RandomGraphs(options["graphs"], seed),
        val=RandomGraphs(600, seed + 1),
        test=RandomGraphs(600, seed + 2),
        collate=pack,
        loss=loss,
        metrics=metrics,
    )
