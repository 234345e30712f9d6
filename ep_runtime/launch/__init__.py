"""``python -m ep_runtime.launch``: launch EP ranks (Ray, spawn or torchrun), run a model-shaped
MoE layer, validate every rank against ``reference_moe``, time each phase and report."""
