"""Seeded draws of graded configurations (issue 39, item 2), shared by the graded tests.

A launch costs seconds, so hypothesis's one-example-per-call shape does not fit a test that
runs on N ranks: the test process draws K configurations from a seed instead, passes them to
ONE launch per world size, and every failure message names the seed. Each CI run takes a new
seed; ``LABKIT_SEED=S`` replays a run, ``LABKIT_LONG=1`` draws ``long`` configurations instead
of ``ci`` (a developer's machine).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

LONG = os.environ.get("LABKIT_LONG") == "1"


def seed() -> int:
    """``LABKIT_SEED`` if set, else a fresh one (drawn once per test process)."""
    global _seed
    if _seed is None:
        _seed = int(os.environ.get("LABKIT_SEED") or random.SystemRandom().randrange(2 ** 31))
    return _seed


_seed: int | None = None


def budget(ci: int, long: int) -> int:
    return long if LONG else ci


def rng(salt: str) -> random.Random:
    """A generator for one test: the run's seed and the test's own salt (a string)."""
    return random.Random(f"{seed()}:{salt}")


def announce(what: str = "") -> int:
    """The run's seed, printed (pytest shows it beside a failing test's report)."""
    print(f"drawn configurations{' of ' + what if what else ''}: LABKIT_SEED={seed()} replays them"
          f"{' (LABKIT_LONG=1)' if LONG else '; LABKIT_LONG=1 draws more'}")
    return seed()


def stream(run_seed: int, test: str) -> random.Random:
    """The same stream on every rank from the seed the test process sent (the configurations
    must agree across ranks), another per test."""
    return random.Random(f"{run_seed}/{test}")


def replay(salt: str = "") -> str:
    """What a failure message appends so that the run can be replayed."""
    return f"[drawn configuration: LABKIT_SEED={seed()} replays it{'; ' + salt if salt else ''}]"


# ----------------------------------------------------------------------------- a drawn model and groups

MLP_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Drawn:
    """A drawn model: layer widths (input first), each layer's dtype and whether it has a
    bias, frozen parameters by name, a tied pair of layers, an unused layer."""
    label: str
    seed: int
    widths: tuple
    dtypes: tuple
    biases: tuple
    frozen: tuple
    tie: tuple | None       # (i, j): layer j uses layer i's weight
    spare: bool             # a layer no forward uses
    loss_scale: float


class DrawnMLP(torch.nn.Module):
    """The ``Drawn`` model: tanh between linear layers, each input cast to its layer's dtype,
    a float32 output plus a buffer. Its weights come from ``seed`` (the spec's by default):
    identical wherever it is built, without touching the global RNG."""

    def __init__(self, spec: Drawn, seed: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(spec.seed if seed is None else seed)
        self.layers = torch.nn.ModuleList()
        for i, (fan_in, fan_out) in enumerate(zip(spec.widths, spec.widths[1:])):
            self.layers.append(torch.nn.Linear(fan_in, fan_out, bias=spec.biases[i], dtype=spec.dtypes[i]))
        if spec.tie:
            i, j = spec.tie
            self.layers[j].weight = self.layers[i].weight
        if spec.spare:
            self.spare = torch.nn.Linear(2, 2, dtype=spec.dtypes[0])
        self.register_buffer("shift", torch.randn(spec.widths[-1], generator=g))
        with torch.no_grad():  # from the seed alone (nn.Linear's own init draws from the global RNG)
            for t in self.parameters():
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
        for name, t in self.named_parameters():
            if name in spec.frozen:
                t.requires_grad_(False)

    def forward(self, x):
        for n, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.dtype))
            x = torch.tanh(x) if n < len(self.layers) - 1 else x
        return x.float() + self.shift


def draw_model(rng, label: str) -> Drawn:
    depth = rng.randint(2, 4)
    widths = tuple(rng.choice((3, 4, 5)) for _ in range(depth + 1))
    dtypes = tuple(rng.choice(MLP_DTYPES) for _ in range(depth))
    biases = tuple(rng.random() < 0.7 for _ in range(depth))
    pairs = [(i, j) for i in range(depth) for j in range(i + 1, depth)
             if widths[i:i + 2] == widths[j:j + 2] and dtypes[i] == dtypes[j]]
    tie = rng.choice(pairs) if pairs and rng.random() < 0.5 else None
    names = [f"layers.{i}.weight" for i in range(depth) if not (tie and i == tie[1])]
    names += [f"layers.{i}.bias" for i in range(depth) if biases[i]]
    frozen = tuple(rng.sample(names, rng.randint(0, len(names) - 1)))  # at least one trains
    scale = rng.uniform(0.25, 4.0)  # a negative one would climb the loss: 5 steps of that diverge
    return Drawn(label, rng.randrange(10 ** 6), widths, dtypes, biases, frozen, tie, rng.random() < 0.4, scale)


def draw_partition(rng, n: int) -> list[list[int]]:
    """The world's ranks shuffled and cut into 1-3 groups (each sorted)."""
    ranks = rng.sample(range(n), n)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(2, n - 1))))
    return [sorted(ranks[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]


def mlp_data(spec: Drawn, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randn(samples, spec.widths[0], generator=g), torch.randn(samples, spec.widths[-1], generator=g)


def mlp_loss(spec: Drawn, model, x, y) -> torch.Tensor:
    """The mean squared error, scaled: the gradient that reaches a hook is not d(mean)/dw."""
    return spec.loss_scale * (model(x).double() - y).pow(2).mean()
