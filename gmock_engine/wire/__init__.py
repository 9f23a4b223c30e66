"""The engine-core wire protocol: pure bytes <-> objects, no sockets.

Everything here follows docs/protocol.md (cited as §N), one module per part:

- `types`: the message-type byte, FinishReason, EngineCoreEventType, the
  constants and the two errors (ProtocolError, BadValue) every part shares;
- `eras`: the layout table of the vLLM eras, the ADD fingerprints and
  `Wire`, the layout one engine speaks (§8);
- `inputs`: decoding and checking what arrives on the input sockets (§3);
- `checks`: an ADD's vllm_xargs and kv_transfer_params, checked once for
  the plans that use them (request.plan, kv_transfer.plan);
- `handshake`: HELLO, INIT, the registration map and READY (§2);
- `outputs`: building and packing what an engine sends (§4).

Import names from the module that defines them: this package re-exports
nothing, so each name has one home.
"""
