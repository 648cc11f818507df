"""Command-line tools that are not services: `kvcentric up`, `sim`, `plan`, `bench replay`, and their plots.

They start processes, read and write files and draw figures; no service imports them.
"""
