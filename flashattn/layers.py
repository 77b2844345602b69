"""The package's layers, top to bottom: what the design page draws and what the import contract checks.

A module imports only modules of its own layer or of the layers below it (``tests/test_layers.py``
reads every import of every module, those inside functions included). The references and the test
helpers stand beside the layers: they read the problem description and the schedule, and no layer
below autograd imports them.
"""

# (layer, what it holds, its modules), top to bottom
LAYERS = (
    ("entry points", "validate the arguments once and build the problem description",
     ("__init__", "api", "compat", "varlen", "decode", "distributed", "fp8", "precompile", "integrations",
      "integrations.transformers")),
    ("autograd and custom operators", "one autograd path per operation; the torch.library operators",
     ("autograd", "custom_ops")),
    ("launchers and kernels", "grids, tiles and launches; the @triton.jit kernels; the one launch layer",
     ("forward", "backward", "decode_kernels", "hopper", "hopper.fwd", "hopper.bwd", "_config", "tensors",
      "launch")),
    ("Gluon kernels", "the @gluon.jit kernels for sm_90, at module scope; imported at their first launch",
     ("hopper.fwd_kernels", "hopper.bwd_kernels", "hopper.common")),
    ("device helpers", "@triton.jit functions the kernels share", ("device_helpers",)),
    ("description and schedule", "the problem description, the block schedule, constants, memo tables, RoPE",
     ("problem", "schedule", "constants", "_memo", "cost", "layers", "rotary")),
)
# beside the layers: module -> the one layer it may import
BESIDE = {"reference": "description and schedule", "testing": "description and schedule"}


def depth(module: str) -> int | None:
    """The layer ``module`` belongs to, counted from the top (0), or None beside the layers or unknown."""
    for index, (_, _, members) in enumerate(LAYERS):
        if module in members:
            return index
    return None
