"""Versioned model store, signed release channels and delta updates (`edgellm store|publish|update|rollback`)."""
