"""The package's version, in a module of its own so that any layer can name it
(``radixserve/__init__.py`` sits at the top: it reaches the Engine)."""

__version__ = "0.1.0"
