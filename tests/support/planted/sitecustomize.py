"""Run by every Python interpreter that has this folder on PYTHONPATH (planted_slowness.environment)."""

import planted_slowness

planted_slowness.from_environment()
