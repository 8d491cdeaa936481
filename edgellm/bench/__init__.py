"""Measurement tools, kept out of the runtime packages (nothing below the apps imports this package).

`edgellm bench` (command, runner, worker, backends, report, stats, system, roofline): edgellm against llama.cpp.
Run as modules: `device` (memory, quality, shift, power, decode on this device; `memory_probe` is one memory row
in a fresh process), `matmul` (the quantized matmul kernels), `constrained` (the cost of constrained decoding),
`schema_corpus` (the real-world schemas in data/schemas) and `schema_suite` (the JSON-Schema-Test-Suite).
"""
