/* The decoder's return codes in words (edgellm_decoder.h): the one place their text is written. */
#include "edgellm_decoder.h"

const char *el_strerror(int code) {
    switch (code) {
        case EL_OK: return "ok";
        case EL_ERR_POSITION: return "position outside the KV cache / RoPE table";
        case EL_ERR_TOKEN: return "token id outside the vocabulary";
        case EL_ERR_MEMORY: return "out of memory for the decoder's buffers";
        case EL_ERR_UNAVAILABLE: return "no native prefill in this kernel library";
        case EL_DESC_FLAGS: return "a family option this library does not implement";
        case EL_DESC_SHAPE: return "dimensions this library does not implement";
        case EL_DESC_EMBED: return "an embedding or LM head of the wrong format or shape";
        case EL_DESC_LAYER: return "a layer's matrix, norm, RoPE table or window missing or of the wrong shape";
        case EL_DESC_OPTION: return "a family option without its weights or value";
        default: return "unknown error code";
    }
}
