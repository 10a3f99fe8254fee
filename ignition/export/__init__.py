"""Export: recorded graphs (addresses as captured) → a runtime core (buffers + relocations)."""
