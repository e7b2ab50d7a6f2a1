"""Relational GNN layers written in hector's builder DSL, with PyG-compatible call signatures."""

from .base import RelationalLayer
from .hgt import HGTConv, load_pyg_hgt
from .rgat import RGATConv
from .rgcn import RGCNConv

__all__ = ["HGTConv", "load_pyg_hgt", "RGATConv", "RGCNConv", "RelationalLayer"]
