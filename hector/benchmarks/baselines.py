"""What a competent PyTorch user writes for RGCN, RGAT and HGT in plain PyTorch: the baselines bench_cuda.py times
hector against (besides PyG).

Once per graph (not timed, as a user would do it once): edges sorted by relation, the per-relation offsets, each
edge's (destination, relation) normaliser. Per step: rows gathered by index, one matmul per relation segment, then
``index_add_`` into destinations, with a segment softmax (``scatter_reduce`` max, exp, ``index_add_`` sum) for the
attention models. Two ways to run the per-relation matmuls:

* ``grouped``: ``torch._grouped_mm`` in bfloat16 (operands cast like autocast does, fp32 accumulation, fp32
  softmax and sums): one kernel for all relations. Needs a GPU that supports it (sm_90); elsewhere it raises.
* ``loop``: one fp32 matmul per relation segment (a Python loop over relations).

The models take their weights from hector's layers (same parameter tensors), so outputs can be compared: with
``loop`` they match hector's layers to fp32 rounding (tested on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Prepared:
    """A graph as the user's layers take it: edges sorted by relation."""

    num_nodes: int
    src: torch.Tensor  # [E] relation-sorted
    dst: torch.Tensor
    etype: torch.Tensor
    counts: list[int]  # edges per relation
    offs: torch.Tensor  # int32 cumulative ends per relation (torch._grouped_mm's offs)
    norm: torch.Tensor  # 1 / |edges into dst of this relation| per sorted edge
    node_type: torch.Tensor | None
    type_rows: list[torch.Tensor] | None  # node ids of each node type


def prepare(edge_index: torch.Tensor, edge_type: torch.Tensor, num_nodes: int, num_relations: int,
            node_type: torch.Tensor | None = None, num_node_types: int | None = None) -> Prepared:
    order = torch.argsort(edge_type, stable=True)
    src, dst, et = edge_index[0][order], edge_index[1][order], edge_type[order]
    counts_t = torch.bincount(et, minlength=num_relations)
    key = dst * num_relations + et
    _, inverse, per_key = torch.unique(key, return_inverse=True, return_counts=True)
    norm = 1.0 / per_key[inverse].float()
    type_rows = None
    if node_type is not None:
        type_rows = [(node_type == t).nonzero().flatten() for t in range(num_node_types or int(node_type.max()) + 1)]
    return Prepared(num_nodes, src, dst, et, counts_t.tolist(), torch.cumsum(counts_t, 0).to(torch.int32), norm,
                    node_type, type_rows)


def seg_mm(a: torch.Tensor, w: torch.Tensor, g: Prepared, mode: str) -> torch.Tensor:
    """Row i of the relation-sorted rows ``a`` [E, K] times ``w[relation(i)]`` ([R, K, N]) -> [E, N]."""
    if mode == "grouped":
        return torch._grouped_mm(a.to(torch.bfloat16), w.to(torch.bfloat16), offs=g.offs)
    out = a.new_empty(a.size(0), w.size(-1))
    start = 0
    for r, c in enumerate(g.counts):
        if c:
            out[start:start + c] = a[start:start + c] @ w[r]
            start += c
    return out


def segment_softmax(score: torch.Tensor, index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Softmax of ``score`` [E, H] over the edges of each destination ``index``, max-subtracted, in fp32."""
    score = score.float()
    idx = index.unsqueeze(-1).expand_as(score)
    m = torch.full((num_nodes, score.size(1)), -math.inf, device=score.device)
    m = m.scatter_reduce(0, idx, score.detach(), "amax", include_self=True)
    e = torch.exp(score - m.index_select(0, index))
    z = torch.zeros_like(m).index_add_(0, index, e)
    return e / z.index_select(0, index)


class UserRGCN(torch.nn.Module):
    """hector's RGCNConv formula (mean per relation and destination, root weight, bias) in plain PyTorch."""

    def __init__(self, layer, mode: str):
        super().__init__()
        self.layer, self.mode = layer, mode

    def forward(self, x: torch.Tensor, g: Prepared) -> torch.Tensor:
        m = self.layer
        w = m.weight if m.comp is None else torch.einsum("rb,bio->rio", m.comp, m.weight)
        msg = seg_mm(x.index_select(0, g.src), w, g, self.mode).float() * g.norm.unsqueeze(1)
        out = torch.zeros(g.num_nodes, msg.size(1), device=x.device).index_add_(0, g.dst, msg)
        if m.root is not None:
            out = out + x @ m.root
        return out + m.bias if m.bias is not None else out


class UserRGAT(torch.nn.Module):
    """PyG's RGATConv formula (hector's ``attention="shared"``: additive self-attention, across relations)."""

    def __init__(self, layer, mode: str):
        super().__init__()
        self.layer, self.mode = layer, mode

    def forward(self, x: torch.Tensor, g: Prepared) -> torch.Tensor:
        m = self.layer
        h, c = m.heads, m.out_channels
        w = m.weight if m.num_bases is None else torch.einsum("rb,bio->rio", m.att, m.basis)
        hs = seg_mm(x.index_select(0, g.src), w, g, self.mode).float()
        hd = seg_mm(x.index_select(0, g.dst), w, g, self.mode).float()
        score = F.leaky_relu(hd @ m.q + hs @ m.k, m.negative_slope)
        alpha = segment_softmax(score, g.dst, g.num_nodes)
        msg = hs.view(-1, h, c) * alpha.unsqueeze(-1)
        out = torch.zeros(g.num_nodes, h, c, device=x.device).index_add_(0, g.dst, msg).view(g.num_nodes, h * c)
        return out + m.bias if m.bias is not None else out


class UserHGT(torch.nn.Module):
    """PyG's HGTConv formula on a typed homogeneous graph (hector's HGTConv), per-head relation maps as segment
    matmuls over the relation-sorted edges."""

    def __init__(self, layer, mode: str):
        super().__init__()
        self.layer, self.mode = layer, mode

    def _typed(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: Prepared) -> torch.Tensor:
        out = x.new_empty(x.size(0), w.size(-1))
        for t, rows in enumerate(g.type_rows):
            if rows.numel():
                out[rows] = x.index_select(0, rows) @ w[t] + b[t]
        return out

    def forward(self, x: torch.Tensor, g: Prepared) -> torch.Tensor:
        m = self.layer
        h, f = m.heads, m.out_channels
        d = f // h
        k = self._typed(x, m.k_weight, m.k_bias, g).view(-1, h, d)
        q = self._typed(x, m.q_weight, m.q_bias, g).view(-1, h, d)
        v = self._typed(x, m.v_weight, m.v_bias, g).view(-1, h, d)
        ks, vs = k.index_select(0, g.src), v.index_select(0, g.src)
        k_e = torch.stack([seg_mm(ks[:, i], m.k_rel[:, i], g, self.mode) for i in range(h)], 1).float()
        v_e = torch.stack([seg_mm(vs[:, i], m.v_rel[:, i], g, self.mode) for i in range(h)], 1).float()
        score = (q.index_select(0, g.dst) * k_e).sum(-1) * m.p_rel.index_select(0, g.etype) / math.sqrt(d)
        alpha = segment_softmax(score, g.dst, g.num_nodes)
        agg = torch.zeros(g.num_nodes, h, d, device=x.device).index_add_(0, g.dst, v_e * alpha.unsqueeze(-1))
        a = self._typed(F.gelu(agg.view(-1, f)), m.out_weight, m.out_bias, g)
        if m.in_channels != m.out_channels:
            return a
        s = torch.sigmoid(m.skip.index_select(0, g.node_type)).unsqueeze(1)
        return s * a + (1 - s) * x


USER_MODELS = {"rgcn": UserRGCN, "rgat": UserRGAT, "hgt": UserHGT}


def grouped_mm_available(device: str) -> str | None:
    """Why ``torch._grouped_mm`` cannot run here (None: it can), from one tiny call."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    try:
        a = torch.randn(32, 16, device=device, dtype=torch.bfloat16)
        w = torch.randn(2, 16, 16, device=device, dtype=torch.bfloat16)
        torch._grouped_mm(a, w, offs=torch.tensor([16, 32], dtype=torch.int32, device=device))
    except Exception as e:  # a missing kernel is reported as the baseline's result, not raised
        return f"torch._grouped_mm unavailable: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
    return None


__all__ = ["USER_MODELS", "Prepared", "UserHGT", "UserRGAT", "UserRGCN", "grouped_mm_available", "prepare",
           "seg_mm", "segment_softmax"]


def user_steps(kind: str, layer: torch.nn.Module, x: torch.Tensor, g: Prepared, mode: str, compiled: bool,
               backend: str = "inductor"):
    """(train step, inference) closures of the user's model built on ``layer``'s weights; ``compiled`` wraps the
    model in ``torch.compile`` (the graph is a constant of the closure, so it is traced once)."""
    model = USER_MODELS[kind](layer, mode)
    fn = torch.compile(model, backend=backend) if compiled else model
    xg = x.clone().requires_grad_()

    def train():
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        fn(xg, g).float().sum().backward()

    def infer():
        with torch.no_grad():
            fn(x, g)

    return train, infer


__all__ += ["user_steps"]
