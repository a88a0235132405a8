"""The engine core: requests and their sequences, sampling parameters, the block manager, the scheduler,
``EngineCore`` (schedule → execute → update) and its outputs. No I/O, no wire types, no text."""
