"""`python -m memopd ...`: the same command line as the `memopd` script (`memopd.cli:main`,
pyproject's [project.scripts]), with its exit codes."""
import sys

from memopd.cli import main

if __name__ == "__main__":
    sys.exit(main())
