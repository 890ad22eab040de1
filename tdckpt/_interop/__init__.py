"""Other tools' formats: safetensors out and in (:mod:`tdckpt._interop.safetensors`)."""
