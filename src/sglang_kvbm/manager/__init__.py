"""The block manager: one worker's host tier and the chain below it, and a block's way down and back up.

``block_manager`` is the facade (:class:`~sglang_kvbm.manager.block_manager.LocalBlockManager`);
``offloads`` takes blocks down (device -> host -> lower tiers), ``lookups`` finds them and pins
what a load will read, ``loads`` and ``layer_loader`` bring them back up layer by layer under the
forward; ``sidecars`` does the same for a hybrid model's other pools; ``build`` makes a worker's
managers from its pools and the configuration, whatever the engine.
"""
