"""Synthetic twins of the Hector evaluation graphs (aifb, mutag, bgs, am, mag, wikikg2, fb15k, biokg)."""

from .synthetic import SPECS, DatasetSpec, SyntheticGraph, generate, load

__all__ = ["SPECS", "DatasetSpec", "SyntheticGraph", "generate", "load"]
