"""Stand-in for the xprof package: just enough for ``import tokamax``."""
