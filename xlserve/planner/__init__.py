"""Memory planning: how a model's weights, activations and KV cache fill a set of devices."""
