import sys

from unison.cli import main

sys.exit(main())
