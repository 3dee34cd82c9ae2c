import sys

from tabfm.cli import main

sys.exit(main())
