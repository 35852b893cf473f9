"""Entry point of the frozen (PyInstaller) build: the ``dcpstudio`` command.

``freeze_support`` must run first: the multi-rank loader spawns ranks by re-running this
executable, and those children must become ranks instead of starting the CLI again.
"""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from dcpstudio.cli.main import main

    sys.exit(main())
