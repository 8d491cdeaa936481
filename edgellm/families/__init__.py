"""What each model architecture is, as data: its config (ModelConfig, read from config.json or GGUF metadata),
its tensors' names and shapes, where they come from in each source, and the checks an artifact's tensors must pass
(tensor_specs). One file per family plus one line in registry.py. Nothing here runs a model (that is models/)."""
