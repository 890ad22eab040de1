"""Other tools' formats: safetensors out and in (:mod:`tdckpt._interop.safetensors`; one
file's writing in :mod:`tdckpt._interop.safetensors_write`)."""
