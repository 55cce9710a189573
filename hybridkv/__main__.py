"""``python -m hybridkv`` runs the command line."""

import sys

from hybridkv.cli.main import main

sys.exit(main())
