"""`python -m sparsegen` runs the same command line as the `sparsegen` script."""
from .cli import main

raise SystemExit(main())
