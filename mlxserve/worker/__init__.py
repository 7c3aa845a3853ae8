"""Everything that touches the device: the model runner, the sampler, memory planning."""
