import sys

from purinec.cli import main

sys.exit(main())
