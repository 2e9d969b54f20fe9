"""A molecular property model built the way graph-learning groups build them, with PyTorch
Geometric:

    qgtrain train --config config.yaml --config jobs/molecules.yaml

GIN message passing blocks with batch norm, global mean pooling, PyG `Data` samples collated into a
PyG `Batch`, and a dict of outputs: two properties of each generated molecule, how many rings it has
(0, 1 or 2: a class) and the share of its atoms that are nitrogen or oxygen (a number). Molecules
are made from their index and seed alone (no download): a random tree of 6 to 24 atoms closed into
rings of 3 to 5 atoms, so the ring count is exact by construction and the model must see local
structure to tell it.

Batch norm keeps running statistics in buffers that each rank updates from its own batch; under ddp
qgtrain saves rank 0's (README: "Buffers and batch norm under ddp"). Under fsdp the blocks are
sharded one by one: `train.shard_modules: [GINBlock]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torch_geometric.data import Batch, Data
from torch_geometric.nn import BatchNorm, GINConv, global_mean_pool

import qgtrain

ATOMS = ("C", "N", "O", "S", "F")
ABUNDANCE = (0.62, 0.14, 0.14, 0.05, 0.05)
POLAR = (1, 2)  # N and O
RINGS = 3  # 0, 1 or 2 rings


class Molecules(Dataset):
    """Molecule i is made from its own seed, so any sample can be read at any time, by any rank or
    worker."""

    def __init__(self, size: int, seed: int, min_atoms: int = 6, max_atoms: int = 24) -> None:
        self.size, self.seed, self.min_atoms, self.max_atoms = size, seed, min_atoms, max_atoms

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Data:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        atoms = int(torch.randint(self.min_atoms, self.max_atoms + 1, (1,), generator=gen))
        kinds = torch.multinomial(torch.tensor(ABUNDANCE), atoms, replacement=True, generator=gen)
        # A chain with side branches, as molecules are: each atom bonds to one of the three before
        # it.
        later = torch.arange(1, atoms)
        first = (later - 3).clamp(min=0)
        parent = [
            0,
            *(first + (torch.rand(atoms - 1, generator=gen) * (later - first)).long()).tolist(),
        ]
        bonds = [(parent[atom], atom) for atom in range(1, atoms)]
        closures = [
            (ancestor, atom)
            for atom in range(1, atoms)
            for ancestor in _ancestors(parent, atom)[1:4]
        ]
        rings = index % RINGS  # each bond beyond a tree's closes one ring; 6 atoms always allow two
        bonds += [
            closures[i] for i in torch.randperm(len(closures), generator=gen)[:rings].tolist()
        ]
        edges = torch.tensor(bonds).T
        polar = sum(int(kinds.eq(k).sum()) for k in POLAR) / atoms
        return Data(
            x=kinds,
            edge_index=torch.cat([edges, edges.flip(0)], dim=1),
            rings=torch.tensor([rings]),
            polarity=torch.tensor([polar]),
        )


def _ancestors(parent: list[int], atom: int) -> list[int]:
    """The atoms from `atom`'s parent up to the first atom: bonding to the k-th closes a ring of k +
    2."""
    chain = []
    while atom:
        atom = parent[atom]
        chain.append(atom)
    return chain


def collate(samples: list[Data]) -> Batch:
    """PyG's own batching: one graph of all the molecules, `batch` saying whose each atom is."""
    return Batch.from_data_list(samples)


class GINBlock(nn.Module):
    """One round of message passing: GIN's sum over neighbours through an MLP, batch norm, a
    residual."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.conv = GINConv(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        )
        self.norm = BatchNorm(hidden)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return h + F.relu(self.norm(self.conv(h, edge_index)))


class MoleculeModel(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(ATOMS), hidden)
        self.blocks = nn.ModuleList(GINBlock(hidden) for _ in range(layers))
        self.rings = nn.Linear(hidden, RINGS)
        self.polarity = nn.Linear(hidden, 1)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        h = self.embed(batch.x)
        for block in self.blocks:
            h = block(h, batch.edge_index)
        pooled = global_mean_pool(h, batch.batch, size=batch.num_graphs)
        # (graphs, 3), (graphs, 1)
        return {"rings": self.rings(pooled), "polarity": self.polarity(pooled)}


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(batch)
    return F.cross_entropy(out["rings"], batch.rings) + 10 * F.mse_loss(
        out["polarity"][:, 0], batch.polarity
    )


def metrics(model: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, int]]:
    """Sums and counts: qgtrain adds them up over every rank before dividing."""
    out = model(batch)
    return {
        "ring_accuracy": ((out["rings"].argmax(dim=1) == batch.rings).sum(), batch.num_graphs),
        "polarity_mae": ((out["polarity"][:, 0] - batch.polarity).abs().sum(), batch.num_graphs),
    }


def molecules(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Options (task.options): molecules (training set size), hidden, layers."""
    options = {"molecules": 4000, "hidden": 64, "layers": 3, **cfg.task.options}
    seed = cfg.train.seed
    return qgtrain.Task(
        model=MoleculeModel(options["hidden"], options["layers"]),
        train=Molecules(options["molecules"], seed),
        val=Molecules(501, seed + 1),
        test=Molecules(499, seed + 2),
        collate=collate,
        loss=loss,
        metrics=metrics,
    )
