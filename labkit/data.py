"""Learnable data made on the spot: nothing is downloaded, everything comes from a seed.

Every function draws from its own torch.Generator, so the same arguments give
the same tensors in every process and no call disturbs the global RNG.

A seed fixes both the hidden rule (Markov chain, teacher) and the samples
drawn from it. For held-out data, make one larger set and slice it: a
different seed is a different rule, not fresh samples of the same one.
"""

import torch

SUCCESSORS = 3  # likely next tokens per token
SMOOTHING = 0.01  # probability mass spread over all tokens, so every state is reachable


def _transition_table(vocab_size, gen):
    """A [vocab_size, vocab_size] row-stochastic matrix, peaked on a few successors."""
    table = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for token in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=gen)[:SUCCESSORS]
        weights = torch.rand(SUCCESSORS, generator=gen, dtype=torch.float64) + 0.2
        table[token, successors] = weights / weights.sum()
    # The uniform sliver makes the chain irreducible and aperiodic: it has one
    # stationary distribution, and power iteration is sure to find it.
    return (1 - SMOOTHING) * table + SMOOTHING / vocab_size


def _stationary(table, iters=1000):
    dist = torch.full((table.shape[0],), 1.0 / table.shape[0], dtype=torch.float64)
    for _ in range(iters):
        dist = dist @ table
    return dist


def markov_tokens(num_sequences, block_size, vocab_size, seed=0):
    """Sequences from a fixed random first-order Markov chain.

    Returns (x, y), LongTensors of shape [num_sequences, block_size], with
    y[:, t] == x[:, t + 1]: y is the next token after each x.
    """
    gen = torch.Generator().manual_seed(seed)
    table = _transition_table(vocab_size, gen)
    # Start from the stationary distribution, so that every position has the
    # same statistics and the best achievable loss is the entropy rate.
    tokens = torch.empty(num_sequences, block_size + 1, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(_stationary(table), num_sequences, replacement=True, generator=gen)
    for t in range(block_size):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=gen).squeeze(1)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def markov_entropy(vocab_size, seed=0):
    """Entropy rate of the chain markov_tokens(..., vocab_size, seed) samples from, in nats.

    This is the floor of the next-token cross-entropy: a model that knew the
    transition table exactly would score it, and none can do better.
    """
    table = _transition_table(vocab_size, torch.Generator().manual_seed(seed))
    row_entropy = -(table * table.log()).sum(dim=1)  # uncertainty of the next token, per current token
    return float(_stationary(table) @ row_entropy)


def regression(num_samples, d_in, d_out, seed=0):
    """(x, y) float tensors: y = tanh(x @ W + b) + small noise, for a fixed random teacher (W, b)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(d_in, d_out, generator=gen) / d_in**0.5  # keeps x @ W near unit scale
    bias = torch.randn(d_out, generator=gen) * 0.1
    x = torch.randn(num_samples, d_in, generator=gen)
    noise = torch.randn(num_samples, d_out, generator=gen) * 0.01
    return x, torch.tanh(x @ weight + bias) + noise


def batches(x, y, batch_size, seed=0):
    """One epoch of (xb, yb) pairs in a seeded shuffled order.

    Every sample appears exactly once; the last batch is smaller when
    batch_size does not divide the dataset.
    """
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return [(x[idx], y[idx]) for idx in order.split(batch_size)]
