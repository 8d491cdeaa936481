"""Versioned model store and signed release channels: local versions, channel indexes, trust keys, freshness (the
update flow and the `edgellm store|publish|update|rollback` commands are `edgellm.updates`)."""
