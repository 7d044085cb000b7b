"""omniloop: a generation runtime where the runtime owns the loops."""

__version__ = "0.1.0"
