import sys

from env_engineer.cli import main

sys.exit(main())
