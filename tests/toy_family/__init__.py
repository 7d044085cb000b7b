"""The toy family: a family that lives outside ``src/`` and registers through the
``omniloop.families`` entry point, as a third-party package's would (docs/adding-a-family.md;
tests/test_toy_family.py runs it through the engine, the CLI and the server).

Importing the package registers it."""

from . import spec as _spec  # noqa: F401
