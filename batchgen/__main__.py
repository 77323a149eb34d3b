"""``python -m batchgen``: the same as the ``batchgen`` script."""
from batchgen.cli import main

main()
