"""Native CPU kernels (C, compiled per instruction-set variant at install) and their loader."""
