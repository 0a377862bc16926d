"""CPU micro-benchmarks: the measurements behind flaxchat.kernels.cpu (docs/cpu.md lists them)."""
