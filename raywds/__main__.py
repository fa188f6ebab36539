"""`python -m raywds ...` is the `raywds` command; `torchrun --nproc-per-node N -m raywds train ...`
runs it as N DDP ranks."""

import sys

from raywds.cli.main import main

sys.exit(main())
