#!/usr/bin/env python3
"""Replace a plain PyTorch MoE block (router + experts as nn.Linear) by the megamoe layer.

    python examples/moe_block.py                  # cpu backend without a GPU, routed with one
    python examples/moe_block.py --backend cpu --tokens 64 --experts 16 --top-k 4

Builds a small SwiGLU MoE block in PyTorch, runs it, builds a megamoe layer from the block's own
nn.Linear weights (w13 = [gate; up] per expert, w2 = down), runs it on the same routing, and prints the
relative L2 difference between the two outputs. Needs torch (pip install torch); importing this file
needs nothing.
"""
from __future__ import annotations

import argparse
import sys


def build_block(torch, hidden, intermediate, num_experts, top_k):
    nn = torch.nn

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
            self.up_proj = nn.Linear(hidden, intermediate, bias=False)
            self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class MoeBlock(nn.Module):
        """The reference: softmax top-k routing, renormalised, and a loop over experts."""

        def __init__(self):
            super().__init__()
            self.router = nn.Linear(hidden, num_experts, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(num_experts))

        def route(self, x):
            probs = torch.softmax(self.router(x).float(), dim=-1)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)

        def forward(self, x):
            ids, weights = self.route(x)
            y = torch.zeros_like(x, dtype=torch.float32)
            for e, expert in enumerate(self.experts):
                rows, slots = torch.nonzero(ids == e, as_tuple=True)
                if rows.numel():
                    y.index_add_(0, rows, weights[rows, slots, None] * expert(x[rows]).float())
            return y.to(x.dtype)

    return MoeBlock()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=None, help="cpu, routed or auto (default: routed with a GPU, else cpu)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    import megamoe
    import megamoe.torch as mt

    torch.manual_seed(args.seed)
    gpu = torch.cuda.is_available()
    backend = args.backend or ("routed" if gpu else "cpu")
    device = torch.device("cuda" if backend != "cpu" and gpu else "cpu")
    block = build_block(torch, args.hidden, args.intermediate, args.experts, args.top_k).to(device, torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)

    with torch.no_grad():
        y_torch = block(x)
        ids, weights = block.route(x)
        # The experts' weights as megamoe takes them: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
        w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in block.experts])
        w2 = torch.stack([e.down_proj.weight for e in block.experts])

    geometry = megamoe.MoeGeometry(hidden=args.hidden, intermediate=args.intermediate, num_experts=args.experts,
                                   top_k=args.top_k, max_tokens_per_rank=args.tokens)
    config = megamoe.MoeConfig(backend=backend, weight_format="bf16", dispatch_format="bf16")
    layer = mt.MoeLayer(geometry, megamoe.MoeWeights(w13, w2), config).warmup()
    y_mega = layer(x, ids, weights)
    layer.check_error()

    diff = float((y_mega.float() - y_torch.float()).norm() / y_torch.float().norm())
    print(f"megamoe {megamoe.__version__}: backend={megamoe._C.name_of(layer.backend)} on {layer.device}; "
          f"{args.tokens} tokens, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.experts} experts, top-{args.top_k}")
    print(f"rel L2 difference, megamoe vs the PyTorch block: {diff:.3e}  (both bf16; the block rounds each "
          f"nn.Linear output to bf16, megamoe keeps fp32 until its documented rounding points)")
    layer.release()
    return 0 if diff < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
