"""Model code shared by the attention and expert services: config, checkpoint, layer math."""
