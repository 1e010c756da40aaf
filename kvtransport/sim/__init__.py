"""The virtual-clock shell and the simulators; the evaluation's clairvoyant references."""
