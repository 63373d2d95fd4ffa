import sys

from purinec.cli import command

sys.exit(command())
