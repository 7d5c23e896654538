"""moshpitd: the Moshpit All-Reduce daemon (no torch in here: numpy only)."""

__version__ = "0.1.0"
