"""Other tools' formats: safetensors out and in (:mod:`tdckpt._interop.safetensors`; one
file's writing in :mod:`tdckpt._interop.safetensors_write`, the format's names and its
reader in :mod:`tdckpt._interop.safetensors_read`); TorchRL checkpoints checked
without TorchRL (:mod:`tdckpt._interop.torchrl_checkpoint`), the tdckpt payload of a TorchRL
component (:mod:`tdckpt._interop.torchrl_payload`) and a replay buffer's storage dumped by
tdckpt (:mod:`tdckpt._interop.torchrl_storage`, which needs TorchRL; re-exported by
:mod:`tdckpt.torchrl`)."""
