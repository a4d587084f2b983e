"""Integrations with other libraries, each imported on its own (nothing is imported here).

- ``speedcore.integrations.torch_ops``: ``torch.ops.speedcore.*`` for torch.compile and CUDA graphs (the public
  functions reach it by themselves while torch.compile traces; importing it registers the ops).
"""
