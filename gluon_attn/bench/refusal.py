"""``Unsupported``: what a --na provider raises when it cannot run a problem (its row says why); a module of its own,
so that providers in other modules raise it without importing the sweep."""


class Unsupported(Exception):
    pass
