import sys

from kvdepotd.cli import main

sys.exit(main())
