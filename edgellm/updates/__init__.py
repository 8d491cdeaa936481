"""Updates from a signed release channel, above the runtime: `update` (download, verify, gate a new version on the
engine and the eval tasks, then switch), `repair` (re-fetch damaged files), and `cli` (the `edgellm store`,
`publish`, `update` ... commands). The store itself (local versions, channels, trust) is `edgellm.store`."""
