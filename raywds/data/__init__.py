"""Shards and where they live: the source layouts, convert, the manifest, tar reading, verify, the
demo data; the stores (local, http(s), s3, gs, pipe:) and shard lists; index and --data for shards
anyone wrote. Imports neither torch nor webdataset (a test checks it in a fresh interpreter)."""
