"""Shards on disk: the source layouts, convert, the manifest, tar reading, verify and the demo
data. Imports neither torch nor webdataset (a test checks it in a fresh interpreter)."""
