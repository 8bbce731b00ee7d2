"""aivedio: the control plane that carries AI video task status from providers to browsers."""

__version__ = "0.1.0"
