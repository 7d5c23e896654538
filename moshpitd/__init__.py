"""moshpitd: the Moshpit All-Reduce daemon (no torch in here: numpy only).

Importing it changes nothing in the importing process; the daemon's process settings are
made by its entry point (moshpitd/cli.py).
"""

__version__ = "0.1.0"
