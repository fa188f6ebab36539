"""One rank's training: model, optimizer and schedule, the epoch loop, collectives, the
ledger of samples seen, checkpoints, the run directory and progress. Never imports ray."""
