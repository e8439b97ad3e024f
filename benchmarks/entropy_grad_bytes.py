"""Bytes the backward allocates when entropies are computed but no loss uses them (TRL's entropy bonus off), against
the same backward with an entropy gradient (what every call paid before unused outputs got no gradient).

Run:
  PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/entropy_grad_bytes.py > benchmarks/entropy_grad_bytes_cpu.txt
Counts the bytes of every tensor the backward's aten ops return (deterministic; no allocator statistics on CPU).
"""

import torch
from integrations.test_trl_signals import _BytesAllocated

import sharedprefix as sp
from helpers import tiny_model

V, P, G, T = 32000, 64, 4, 128


def backward_bytes(model, groups, use_entropy: bool) -> int:
    out = sp.logprobs(model, groups, entropy=True)
    loss = out.logprobs.sum() + (out.entropy.sum() * 0.0 if use_entropy else 0.0)
    with _BytesAllocated() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.bytes


if __name__ == "__main__":
    model = tiny_model(dtype=torch.float32, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    groups = [
        sp.Group(
            torch.randint(0, V, (P,), generator=g).tolist(),
            [torch.randint(0, V, (T,), generator=g).tolist() for _ in range(G)],
        )
    ]
    used, unused = backward_bytes(model, groups, True), backward_bytes(model, groups, False)
    print(f"M={G * T} predicted tokens, V={V}, float32 (prompt {P}, {G} completions of {T})")
    print(f"backward bytes with an entropy gradient: {used / 2**20:.1f} MiB; without: {unused / 2**20:.1f} MiB")
    one = G * T * V * 4 / 2**20
    print(
        f"saved: {(used - unused) / 2**20:.1f} MiB (one (M, V) float32 matrix: {one:.1f} MiB); ratio "
        f"{unused / used:.3f}"
    )
