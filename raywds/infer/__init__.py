"""Using a trained model on data: `raywds evaluate` and `raywds predict`, per rank, over the same
planner and loader as training (no optimizer); their launchers for Ray are in raywds.launch."""
