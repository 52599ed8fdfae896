"""`python -m sparsegen` runs the same command line as the `sparsegen` script."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
