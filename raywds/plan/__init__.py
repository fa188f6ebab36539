"""What each rank and loader worker reads in an epoch, the modes that decide it, the checks
that refuse a plan that would hang, and the position a resumed epoch starts from. No torch."""
