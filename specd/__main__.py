import sys

from specd.cli import main

sys.exit(main())
