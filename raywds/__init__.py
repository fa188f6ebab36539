"""raywds: train image classifiers from WebDataset tar shards, on one machine or a Ray cluster."""

__version__ = "0.1.0"
