"""Packages are found, not listed: a subpackage left out of a hand-written list ships a daemon
that dies at import (tests/unit/test_wheel.py installs the wheel and runs it). Only the daemon's
tree and the client, installed as `moshpit`, ship: a bare find would also take bench, demo,
netlab and tests. Everything else is in setup.cfg."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["moshpitd", "moshpitd.*"]),
                "moshpit", *(f"moshpit.{name}" for name in find_packages("client"))])
