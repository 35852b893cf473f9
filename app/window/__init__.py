"""DCP Studio's PySide6 window. All Qt code lives in this package; it calls ``dcpstudio.core``."""
