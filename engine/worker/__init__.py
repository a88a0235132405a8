"""The worker: the model runner (the only code that touches the model's tensors) and the batched sampler."""
