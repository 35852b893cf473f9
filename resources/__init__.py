"""Package data of DCP Studio: the application icon and the desktop entry (``dcpstudio.resources``)."""
