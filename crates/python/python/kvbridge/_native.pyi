"""Type stubs of the native module (the public names are re-exported by ``kvbridge``)."""

__version__: str
