import sys

from moshpitd.cli import main

sys.exit(main())
