"""A run folder, local or in a bucket: its files, the lock, the rows, checkpoints, TensorBoard,
following a run as it trains and `raywds report`. Below raywds.train; imports neither it nor
raywds.loader."""
