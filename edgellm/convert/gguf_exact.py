"""The GGUF tensor types whose values edgellm's formats hold exactly, and in which formats: what the `source`
scheme takes and what the memory planner predicts for a GGUF it has not compiled. Needs no torch (gguf-py's
constants only), so the planner can read a GGUF header without loading the converter."""

from __future__ import annotations

from gguf import GGMLQuantizationType

# GGUF tensor types whose values edgellm's formats hold exactly, fewest bits first (what the source scheme takes):
# Q4_1 is el_block_q4 byte for byte, Q8_0 el_block_q8, Q4_0 / IQ4_NL / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K
# are q4_0 / iq4_nl / q5_0 / q5_1 / q2_k / q3_k / q4_k / q5_k / q6_k (the GGUF's blocks, interleaved); Q4_0 (d * (q - 8))
# is also q4 with m = -8 d, and Q4_0 / Q5_0 / IQ4_NL q8 with the same d and q - 8 / q - 16 / the IQ4_NL table's value
# (-127..113); F16 values are halves, BF16 and F32 values floats.
EXACT_FORMATS: dict[GGMLQuantizationType, tuple[str, ...]] = {
    GGMLQuantizationType.Q4_1: ("q4",),
    GGMLQuantizationType.Q8_0: ("q8",),
    GGMLQuantizationType.Q4_0: ("q4_0", "q4", "q8"),
    GGMLQuantizationType.Q5_0: ("q5_0", "q8"),
    GGMLQuantizationType.IQ4_NL: ("iq4_nl", "q8"),
    GGMLQuantizationType.Q5_1: ("q5_1",),
    GGMLQuantizationType.Q2_K: ("q2_k",),
    GGMLQuantizationType.Q3_K: ("q3_k",),
    GGMLQuantizationType.Q4_K: ("q4_k",),
    GGMLQuantizationType.Q5_K: ("q5_k",),
    GGMLQuantizationType.Q6_K: ("q6_k",),
    GGMLQuantizationType.F16: ("f16", "f32"),
    GGMLQuantizationType.BF16: ("f32",),
    GGMLQuantizationType.F32: ("f32",),
}
