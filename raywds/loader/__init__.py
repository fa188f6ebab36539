"""From shard URLs to batches on one rank: readers, the pipeline stages, the DataLoader, JPEG
decoding (with the `_jpeg` region decoder), shared-memory blocks and the shuffle replay.
Never uses torch.distributed."""
