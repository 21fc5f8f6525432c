"""The sharding runtime: ZeRO stages 0-3 and HYBRID_SHARD over flat buffers.

``flat`` is the layout table every buffer comes from; ``accounting`` the
stage formulas, written once; ``optim`` AdamW and the loss scaler; ``zero``
the engine; ``checkpoint`` sharded save, load and export. The runtime imports
no model: it is handed an object that follows ``ringzero.nn``'s unit
contract. It uses ``ringzero.comm`` for every byte it moves.
"""
