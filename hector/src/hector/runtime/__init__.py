"""Graphs and their cached preprocessing, the reference backend, and the autograd bridge."""

from .compiled import CompiledLayer, apply, compile_program
from .graph import Graph, graph_for
from .reference import interpret, run_lowered

__all__ = ["CompiledLayer", "Graph", "apply", "compile_program", "graph_for", "interpret", "run_lowered"]
