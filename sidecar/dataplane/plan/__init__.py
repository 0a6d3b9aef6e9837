"""Pure transfer planning (no I/O, no NIXL): see ``layout`` for the vocabulary and the modules."""
