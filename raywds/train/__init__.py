"""One rank's training: model, optimizer and schedule, the epoch loop and its keeper, collectives,
the ledger of samples seen, and progress (the run folder is raywds.runs). Never imports ray."""
