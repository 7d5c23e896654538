"""moshpitd: the Moshpit All-Reduce daemon (no torch in here: numpy only)."""

import os as _os

# The daemon's numpy work is small per call and runs on the event loop: BLAS thread pools would
# only fight the other daemons and trainers for cores. Must be set before numpy loads.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
